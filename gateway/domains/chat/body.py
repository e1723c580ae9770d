"""The ``POST /v1/chat/completions`` body as a schema type (msgspec), every field accounted for.

Each field of OpenAI's Chat Completions request falls in one of three groups, and a field in
none of them (a typo, another server's extension) is refused with a 400 naming it:

- **honoured**: it changes the output exactly as OpenAI (or, for the extensions, vLLM) defines;
- **ignored**: it cannot change the output (``user``, ``metadata``, ``store``,
  ``prompt_cache_key``, ``prompt_cache_options``, ``prompt_cache_retention`` (caching here is
  automatic and per tenant), ``safety_identifier``): accepted, type-checked and documented as
  ignored (``docs/api.md``);
- **refused**: it would change the output and this server cannot do it (``audio``,
  ``prediction``, ``web_search_options``, ``reasoning_effort``, ``verbosity``, ``moderation``,
  the deprecated
  ``functions`` / ``function_call``, ``modalities`` other than ``["text"]``): a 400 naming it.

vLLM's extensions honoured here: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``guided_json`` / ``guided_regex`` / ``guided_choice``, ``stream_options.continuous_usage_stats``,
``prompt_logprobs`` (the prompt's logprobs, vLLM's response shape) and ``cache_salt``, which
only narrows the prefix cache within the calling tenant (the tenant's id always comes first in
the engine's salt: no client value reaches another tenant's blocks).

Types are checked by msgspec (``null`` is "not given"; an integer is accepted for a number,
never a boolean for either); ranges by :class:`engine.sampling.params.SamplingParams` and
``gateway.domains.chat.schemas``. Litestar documents the type at ``/docs``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from loraplex.gateway.errors import bad_request

IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
)
REFUSED_FIELDS = {
    "suffix": "inserting text before a suffix is not supported by this server's models",
    "audio": "audio output is not supported: this server generates text",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "the served model is not a reasoning model",
    "verbosity": "the served model is not a reasoning model",
    "functions": "'functions' is deprecated and not supported: use 'tools'",
    "function_call": "'function_call' is deprecated and not supported: use 'tool_choice'",
    "moderation": "moderation of inputs and outputs is not offered by this server",
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``stream_options``: OpenAI's ``include_usage``, vLLM's ``continuous_usage_stats``."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's: padding against side channels; ignored


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``tools[].function``: a function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # the arguments always validate (they do here, whatever it says)


class ToolDefinition(msgspec.Struct, forbid_unknown_fields=True):
    """``tools[]``: only ``function`` tools exist in Chat Completions."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    """``tool_choice.function``."""

    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class GenerationFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields Chat Completions and Completions share (OpenAI's, then vLLM's)."""

    model: str
    # OpenAI, honoured
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    service_tier: str | None = None  # auto/default/flex (gateway.domains.chat.service_tier)
    # OpenAI, ignored: they cannot change the output
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    user: str | None = None
    # vLLM's extensions, honoured
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    cache_salt: str | None = None
    prompt_logprobs: int | None = None


class ChatCompletionBody(GenerationFields, kw_only=True):
    """A Chat Completions request body (see the module doc)."""

    messages: list[dict[str, Any]]
    # OpenAI, honoured
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    modalities: list[str] | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[ToolDefinition] | None = None
    top_logprobs: int | None = None
    # OpenAI, refused
    audio: dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionBody(GenerationFields, kw_only=True):
    """A (legacy) Completions request body: one prompt or a batch, as text or token ids.

    OpenAI's ``suffix`` (insertion) is refused; ``best_of`` is accepted only equal to ``n``
    (or 1), where it changes nothing. ``prompt`` is checked by
    ``gateway.domains.chat.completions`` (a batch: a list of strings or of token-id lists).
    """

    prompt: str | list[Any]  # a string, token ids, or a list of strings or of token-id lists
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None  # vLLM's: BOS and the like (default true)


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_FIELD = re.compile(r"field `(?P<name>[^`]+)`")


def convert_body(data: dict[str, Any], kind: type[msgspec.Struct]) -> Any:
    """``data`` (a decoded JSON object) as ``kind``, its first fault a 400 naming the field.

    Raises:
        APIError: 400 for a wrong type, a missing required field or an unknown field, with
            ``param`` the field's dotted path (``stream_options.include_usage``,
            ``stop[2]``); a refused field (:data:`REFUSED_FIELDS`) says why.
    """
    for name, why in REFUSED_FIELDS.items():
        if data.get(name) is not None and name in kind.__struct_fields__:
            raise bad_request(f"'{name}' is not supported: {why}", param=name)
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
    found = _AT.search(message)
    path = found.group("path").lstrip(".") if found else ""
    path = path.replace("[...]", "")
    named = _FIELD.search(message)
    if named is not None:  # unknown or missing field: name it
        path = f"{path}.{named.group('name')}" if path else named.group("name")
    text = message[: found.start()] if found else message
    if text.startswith("Object contains unknown field"):
        text = f"unknown field '{path}': this server does not support it"
    elif path:
        text = f"'{path}': {text}"
    raise bad_request(text, param=path or None)
