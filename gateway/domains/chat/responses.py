"""OpenAI Chat Completions response bodies from engine outputs: the completion, usage, logprobs.

Shapes (OpenAI's API reference, what the ``openai`` SDK parses)::

    chat.completion  {id, object, created, model, choices: [{index, message: {role, content,
                      tool_calls?}, finish_reason, logprobs}], usage}
    usage            {prompt_tokens, completion_tokens, total_tokens,
                      prompt_tokens_details: {cached_tokens}}
    logprobs         {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
    prompt_logprobs  (vLLM's, on the chat.completion and on each text_completion choice)
                     [null, {"<token id>": {logprob, rank, decoded_token}, ...}, ...]: one
                     entry per prompt token, null for the first (nothing precedes it); each
                     holds the prompt token and the top alternatives at its position
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


PromptLogprobs = list[tuple[float, int, list[tuple[int, float]]] | None]
"""The engine's prompt logprobs (``RequestOutput.prompt_logprobs``): None, then per token
``(logprob, rank, [(alternative id, logprob), ...])``."""


def prompt_logprobs_body(
    prompt_ids: list[int], entries: PromptLogprobs, num_top: int, token_bytes: TokenBytes
) -> list[dict[str, dict[str, Any]] | None]:
    """The ``prompt_logprobs`` field (vLLM's): per prompt token, None first, then ``{id: Logprob}``.

    Each position maps ``str(token_id)`` to ``{"logprob", "rank", "decoded_token"}`` for the
    prompt token itself (its rank: 1 + the tokens more likely) and its ``num_top`` most likely
    alternatives (ranks 1 .. num_top), the prompt token first; -inf is -9999.0 (vLLM's
    ``clamp_prompt_logprobs``).

    Args:
        prompt_ids: The prompt: [P].
        entries: The engine's prompt logprobs: [P], None first.
        num_top: Alternatives per position (what the client asked; the engine may hold more).
        token_bytes: Token ids to their bytes (``decoded_token``: decoded, U+FFFD for part of
            a character).
    """
    text = _texts(prompt_ids, entries, num_top, token_bytes)
    body: list[dict[str, dict[str, Any]] | None] = []
    for token, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            body.append(None)
            continue
        lp, rank, tops = entry
        position = {str(token): _logprob(lp, rank, text[token])}
        for r, (t, alt) in enumerate(tops[:num_top], start=1):
            position.setdefault(str(t), _logprob(alt, r, text[t]))
        body.append(position)
    return body


def legacy_prompt_logprobs_body(
    prompt_ids: list[int], entries: PromptLogprobs, num_top: int, token_bytes: TokenBytes
) -> dict[str, Any]:
    """The prompt's part of the Completions API's ``logprobs`` (``echo`` with ``logprobs``).

    The first token's logprob and alternatives are null; each other ``top_logprobs`` maps the
    prompt token and its ``num_top`` most likely alternatives to their logprobs (vLLM's; at most
    ``num_top + 1`` entries, OpenAI's bound). ``text_offset`` starts at 0.
    """
    text = _texts(prompt_ids, entries, num_top, token_bytes)
    tokens, lps, tops, offsets, at = [], [], [], [], 0
    for token, entry in zip(prompt_ids, entries, strict=True):
        tokens.append(text[token])
        offsets.append(at)
        at += len(text[token])
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lp, _, alts = entry
        lps.append(_clamp(lp))
        top = {text[token]: _clamp(lp)}
        for t, alt in alts[:num_top]:
            top.setdefault(text[t], _clamp(alt))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _texts(
    prompt_ids: list[int], entries: PromptLogprobs, num_top: int, token_bytes: TokenBytes
) -> dict[int, str]:
    """Each token id the prompt logprobs name, as text (its bytes, U+FFFD for part of one)."""
    ids = set(prompt_ids)
    for entry in entries:
        if entry is not None:
            ids.update(t for t, _ in entry[2][:num_top])
    ordered = list(ids)
    raw = token_bytes(ordered) if ordered else []
    return {t: b.decode("utf-8", errors="replace") for t, b in zip(ordered, raw, strict=True)}


def _clamp(logprob: float) -> float:
    value = float(logprob)
    return _MIN_LOGPROB if math.isnan(value) or value < _MIN_LOGPROB else value


def _logprob(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": text}


def prompt_part_of(
    out: RequestOutput,
    spans: list[slice] | None,
    body: Callable[[list[int], PromptLogprobs], Any],
) -> Callable[[int], Any]:
    """Choice index -> ``body`` of that choice's own prompt, each prompt's made once.

    Args:
        out: The request's output: ``prompt_token_ids`` and ``prompt_logprobs`` (a batch of
            prompts: every prompt's, concatenated, ``gateway.domains.chat.batch.fan_in``).
        spans: Per choice index, its prompt's slice of both
            (``gateway.domains.chat.batch.prompt_spans``); None: the whole prompt for each.
        body: Makes the part from a prompt's token ids [P] and prompt logprobs [P].

    Returns:
        A function of the choice index; choices of the same prompt share one object.
    """
    made: dict[tuple[int | None, int | None], Any] = {}
    entries = out.prompt_logprobs or []

    def part(index: int) -> Any:
        span = slice(None) if spans is None else spans[index]
        key = (span.start, span.stop)
        if key not in made:
            made[key] = body(out.prompt_token_ids[span], entries[span])
        return made[key]

    return part


def text_completion_body(
    out: RequestOutput,
    *,
    response_id: str,
    created: int,
    model: str,
    want_logprobs: bool,
    token_bytes: TokenBytes,
    echo: str | list[str] = "",
    num_top: int = 0,
    prompt_logprobs: int | None = None,
    prompt_spans: list[slice] | None = None,
) -> dict[str, Any]:
    """The ``text_completion`` object (``POST /v1/completions``) for a finished request.

    Args:
        out: The finished request (its ``prompt_logprobs`` when the engine computed them).
        response_id: ``cmpl-...``.
        created: Unix seconds.
        model: The model as asked.
        want_logprobs: Completions' ``logprobs`` was given.
        token_bytes: Token ids to their bytes.
        echo: The prompt's text when ``echo`` ("" otherwise), or one per choice index (a batch
            of prompts: each choice echoes its own prompt); with ``want_logprobs`` the
            prompt's tokens open each choice's ``logprobs`` too (``num_top`` alternatives).
        num_top: Completions' ``logprobs``: alternatives per token.
        prompt_logprobs: vLLM's ``prompt_logprobs`` as asked: each choice carries them (None:
            not asked, no such key).
        prompt_spans: A batch of prompts: per choice index, its own prompt's slice of
            ``out.prompt_token_ids`` and ``out.prompt_logprobs``, for its prompt part of the
            logprobs and its ``prompt_logprobs`` (``gateway.domains.chat.batch.prompt_spans``);
            None: the whole prompt for every choice.
    """
    prompt_part = None
    if echo and want_logprobs:
        prompt_part = prompt_part_of(
            out,
            prompt_spans,
            lambda ids, lps: legacy_prompt_logprobs_body(ids, lps, num_top, token_bytes),
        )
    vllm_part = None
    if prompt_logprobs is not None:
        vllm_part = prompt_part_of(
            out,
            prompt_spans,
            lambda ids, lps: prompt_logprobs_body(ids, lps, prompt_logprobs, token_bytes),
        )
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        echoed = echo if isinstance(echo, str) else echo[c.index]
        logprobs = None
        if want_logprobs:
            logprobs = legacy_logprobs_body(
                c.token_ids, c.logprobs or [], token_bytes, text_offset=len(echoed)
            )
            if prompt_part is not None:
                mine = prompt_part(c.index)
                logprobs = {k: mine[k] + logprobs[k] for k in mine}
        choice = {
            "index": c.index,
            "text": echoed + c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }
        if vllm_part is not None:
            choice["prompt_logprobs"] = vllm_part(c.index)
        choices.append(choice)
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
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    """The ``chat.completion`` object for a finished request's ``FINAL_ONLY`` output.

    ``tool_calls`` makes a fresh tool-call parser per choice (None: plain text).
    ``prompt_logprobs``: vLLM's field as asked; the body then carries them (vLLM's
    ``ChatCompletionResponse.prompt_logprobs``).
    """
    body = {
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
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(
            out.prompt_token_ids, out.prompt_logprobs or [], prompt_logprobs, token_bytes
        )
    return body
