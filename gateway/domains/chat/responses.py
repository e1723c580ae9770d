"""OpenAI Chat Completions response bodies from engine outputs: the completion, usage, logprobs.

Shapes (OpenAI's API reference, what the ``openai`` SDK parses)::

    chat.completion  {id, object, created, model, choices: [{index, message: {role, content,
                      tool_calls?}, finish_reason, logprobs}], usage}
    usage            {prompt_tokens, completion_tokens, total_tokens,
                      prompt_tokens_details: {cached_tokens}}
    logprobs         {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from loraplex.engine.request import CompletionOutput, RequestOutput
from loraplex.gateway.domains.chat.tool_calls import ToolCallStreamer

# log(0) has no JSON form: vLLM reports -9999.0 for it, and so do we.
_MIN_LOGPROB = -9999.0

TokenBytes = Callable[[list[int]], list[bytes]]
"""Token ids to each token's exact UTF-8 bytes (``engine.sampling.TokenBytes``)."""


def usage_body(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """The ``usage`` object: prompt, completion (every choice) and cached prompt tokens."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def logprobs_body(
    token_ids: list[int],
    logprobs: list[tuple[float, list[tuple[int, float]]]],
    token_bytes: TokenBytes,
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` for generated tokens.

    ``bytes`` is each token's own UTF-8 bytes (part of a character for some tokens), ``token``
    those bytes decoded with U+FFFD for an incomplete character.

    Args:
        token_ids: The tokens: [T].
        logprobs: Per token, ``(its logprob, [(alternative id, logprob), ...])``: [T].
        token_bytes: Token ids to their bytes.
    """
    ids = list(token_ids[: len(logprobs)])
    for _, tops in logprobs:
        ids.extend(t for t, _ in tops)
    raw = dict(zip(ids, token_bytes(ids), strict=True)) if ids else {}
    content = []
    for token, (lp, tops) in zip(token_ids, logprobs, strict=False):
        entry = _entry(raw[token], lp)
        entry["top_logprobs"] = [_entry(raw[t], alt) for t, alt in tops]
        content.append(entry)
    return {"content": content}


def legacy_logprobs_body(
    token_ids: list[int],
    logprobs: list[tuple[float, list[tuple[int, float]]]],
    token_bytes: TokenBytes,
    text_offset: int = 0,
) -> dict[str, Any]:
    """The Completions API's ``logprobs``.

    ``{tokens, token_logprobs, top_logprobs, text_offset}``, each a list over the tokens;
    ``top_logprobs`` maps token text to logprob.

    Args:
        token_ids: The tokens: [T].
        logprobs: Per token, ``(its logprob, [(alternative id, logprob), ...])``: [T].
        token_bytes: Token ids to their bytes.
        text_offset: Characters of text before the first token (an echoed prompt's).
    """
    body = logprobs_body(token_ids, logprobs, token_bytes)["content"]
    offsets, at = [], text_offset
    for entry in body:
        offsets.append(at)
        at += len(entry["token"])
    return {
        "tokens": [e["token"] for e in body],
        "token_logprobs": [e["logprob"] for e in body],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in body],
        "text_offset": offsets,
    }


def text_completion_body(
    out: RequestOutput,
    *,
    response_id: str,
    created: int,
    model: str,
    want_logprobs: bool,
    token_bytes: TokenBytes,
    echo: str | list[str] = "",
) -> dict[str, Any]:
    """The ``text_completion`` object (``POST /v1/completions``) for a finished request.

    ``echo``: the prompt's text before each choice's, or one per choice index (a batch of
    prompts: each choice echoes its own prompt).
    """
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        echoed = echo if isinstance(echo, str) else echo[c.index]
        logprobs = None
        if want_logprobs:
            logprobs = legacy_logprobs_body(
                c.token_ids, c.logprobs or [], token_bytes, text_offset=len(echoed)
            )
        choices.append(
            {
                "index": c.index,
                "text": echoed + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        )
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(
            len(out.prompt_token_ids),
            sum(c.num_tokens for c in out.outputs),
            out.num_cached_tokens,
        ),
    }


def _entry(raw: bytes, logprob: float) -> dict[str, Any]:
    value = float(logprob)
    if math.isnan(value) or value < _MIN_LOGPROB:
        value = _MIN_LOGPROB
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": value, "bytes": list(raw)}


def choice_body(
    choice: CompletionOutput,
    want_logprobs: bool,
    token_bytes: TokenBytes,
    tool_calls: ToolCallStreamer | None = None,
) -> dict[str, Any]:
    """One ``choices[]`` entry of a finished, non-streamed completion.

    With ``tool_calls`` (a fresh parser for the request's tool choice), the text becomes
    ``content`` and ``tool_calls`` as a stream of it would (``ToolCallStreamer.message``: a
    forced call the grammar did not complete is left out).
    """
    logprobs = None
    if want_logprobs:
        logprobs = logprobs_body(choice.token_ids, choice.logprobs or [], token_bytes)
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    finish_reason = choice.finish_reason
    if tool_calls is not None:
        message, finish_reason = tool_calls.message(choice.text, finish_reason)
    return {
        "index": choice.index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": logprobs,
    }


def completion_body(
    out: RequestOutput,
    *,
    response_id: str,
    created: int,
    model: str,
    want_logprobs: bool,
    token_bytes: TokenBytes,
    tool_calls: Callable[[], ToolCallStreamer | None] = lambda: None,
) -> dict[str, Any]:
    """The ``chat.completion`` object for a finished request's ``FINAL_ONLY`` output.

    ``tool_calls`` makes a fresh tool-call parser per choice (None: plain text).
    """
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            choice_body(c, want_logprobs, token_bytes, tool_calls())
            for c in sorted(out.outputs, key=lambda c: c.index)
        ],
        "usage": usage_body(
            len(out.prompt_token_ids),
            sum(c.num_tokens for c in out.outputs),
            out.num_cached_tokens,
        ),
    }
