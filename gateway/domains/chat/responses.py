"""OpenAI Chat Completions response bodies from engine outputs: the completion, usage, logprobs.

Shapes (OpenAI's API reference, what the ``openai`` SDK parses)::

    chat.completion  {id, object, created, model, choices: [{index, message: {role, content},
                      finish_reason, logprobs}], usage}
    usage            {prompt_tokens, completion_tokens, total_tokens,
                      prompt_tokens_details: {cached_tokens}}
    logprobs         {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from loraplex.engine.request import CompletionOutput, RequestOutput

# log(0) has no JSON form: vLLM reports -9999.0 for it, and so do we.
_MIN_LOGPROB = -9999.0

TokenTexts = Callable[[list[int]], list[str]]


def usage_body(out: RequestOutput) -> dict[str, Any]:
    """The ``usage`` object of a request's (final) output."""
    prompt = len(out.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def logprobs_body(
    token_ids: list[int],
    logprobs: list[tuple[float, list[tuple[int, float]]]],
    token_texts: TokenTexts,
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` for generated tokens.

    Args:
        token_ids: The tokens: [T].
        logprobs: Per token, ``(its logprob, [(alternative id, logprob), ...])``: [T].
        token_texts: Token ids to their texts.
    """
    ids = list(token_ids[: len(logprobs)])
    for _, tops in logprobs:
        ids.extend(t for t, _ in tops)
    texts = dict(zip(ids, token_texts(ids), strict=True)) if ids else {}
    content = []
    for token, (lp, tops) in zip(token_ids, logprobs, strict=False):
        entry = _entry(texts[token], lp)
        entry["top_logprobs"] = [_entry(texts[t], alt) for t, alt in tops]
        content.append(entry)
    return {"content": content}


def _entry(text: str, logprob: float) -> dict[str, Any]:
    value = float(logprob)
    if math.isnan(value) or value < _MIN_LOGPROB:
        value = _MIN_LOGPROB
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


def choice_body(
    choice: CompletionOutput, want_logprobs: bool, token_texts: TokenTexts
) -> dict[str, Any]:
    """One ``choices[]`` entry of a finished, non-streamed completion."""
    logprobs = None
    if want_logprobs:
        logprobs = logprobs_body(choice.token_ids, choice.logprobs or [], token_texts)
    return {
        "index": choice.index,
        "message": {"role": "assistant", "content": choice.text},
        "finish_reason": choice.finish_reason,
        "logprobs": logprobs,
    }


def completion_body(
    out: RequestOutput,
    *,
    response_id: str,
    created: int,
    model: str,
    want_logprobs: bool,
    token_texts: TokenTexts,
) -> dict[str, Any]:
    """The ``chat.completion`` object for a finished request."""
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            choice_body(c, want_logprobs, token_texts)
            for c in sorted(out.outputs, key=lambda c: c.index)
        ],
        "usage": usage_body(out),
    }
