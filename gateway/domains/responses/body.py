"""The ``POST /v1/responses`` body as a schema type (msgspec), every field accounted for.

OpenAI's Responses API reference (``ResponseCreateParams`` in the ``openai`` SDK) sorted as the
chat body is (``gateway.domains.chat.body``); a field in no group is a 400 naming it:

- **honoured**: ``model``, ``input``, ``instructions``, ``max_output_tokens``, ``temperature``,
  ``top_p``, ``tools`` (function tools), ``tool_choice``, ``parallel_tool_calls``, ``text``
  (``format``), ``stream``, ``store``, ``previous_response_id``, ``metadata`` (kept on the
  stored response and echoed), ``truncation: "disabled"``, ``background: false``,
  ``include: []``, ``reasoning`` with neither ``effort`` nor ``summary``, ``service_tier``
  (``auto``/``default``/``flex``; ``gateway.domains.chat.service_tier``);
- **ignored** (cannot change the output): ``user``, ``prompt_cache_key``,
  ``prompt_cache_retention``, ``safety_identifier``, ``stream_options`` (OpenAI's
  ``include_obfuscation`` only);
- **refused** (would change the output, or ask for what this server does not keep): see
  :data:`REFUSED`: a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

REFUSED = {
    "background": "background responses are not supported: send 'background': false or leave "
    "it out",
    "conversation": "the Conversations API is not served: use 'previous_response_id'",
    "prompt": "stored prompt templates are not served: send 'input' and 'instructions'",
    "max_tool_calls": "'max_tool_calls' is not supported: use 'parallel_tool_calls': false for "
    "at most one call",
    "top_logprobs": "logprobs are not returned by this server's Responses API: use "
    "/v1/chat/completions with 'logprobs'",
    "moderation": "moderation of inputs and outputs is not offered by this server",
    "context_management": "context compaction is not supported",
}


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``stream_options``: OpenAI's ``include_obfuscation`` only (padding; ignored)."""

    include_obfuscation: bool | None = None


class ResponsesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A Responses API request body (see the module doc).

    ``input``, ``tools``, ``tool_choice``, ``text`` and ``reasoning`` are checked item by item
    by ``gateway.domains.responses.translate`` (each fault a 400 naming its path).
    """

    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    service_tier: str | None = None
    # ignored
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: ResponsesStreamOptions | None = None
    # refused unless null (background: unless false)
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    moderation: dict[str, Any] | None = None
    context_management: list[Any] | None = None
