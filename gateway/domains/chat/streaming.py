"""Server-sent events for ``stream: true``: OpenAI's ``chat.completion.chunk`` sequence.

::

    data: {choices: [{index: i, delta: {role: "assistant", content: ""}}]}   one per choice
    data: {choices: [{index: i, delta: {content: "..."}, logprobs, finish_reason: null}]}
    ...
    data: {choices: [{index: i, delta: {content: "..."}, finish_reason: "stop"}]}
    data: {choices: [], usage: {...}}          only with stream_options.include_usage
    data: [DONE]

A failure after the headers went out (engine death, shutdown) is sent as
``data: {"error": {...}}`` before ``[DONE]``, which the ``openai`` SDK raises as an APIError.
When the client goes away, Litestar cancels this generator: its ``finally`` cancels the run,
which aborts the engine request and records the usage as ``aborted``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.request import RequestOutput
from gateway.domains.chat.responses import TokenTexts, logprobs_body, usage_body
from gateway.domains.chat.service import ChatRun
from gateway.server.errors import APIError, error_body

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class StreamMeta:
    """What every chunk repeats, and what the stream was asked for.

    Attributes:
        response_id: ``chatcmpl-...``.
        created: Unix seconds.
        model: The model as asked.
        n: Choices.
        include_usage: Send ``usage: null`` in every chunk and a last usage chunk.
        want_logprobs: Send each delta's logprobs.
        token_texts: Token ids to texts (for logprobs).
    """

    response_id: str
    created: int
    model: str
    n: int
    include_usage: bool
    want_logprobs: bool
    token_texts: TokenTexts


def sse(obj: Any) -> bytes:
    """One ``data:`` event."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _chunk(meta: StreamMeta, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": meta.response_id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    }
    if meta.include_usage:
        body["usage"] = None
    return body


async def chunk_stream(
    run: ChatRun, first: RequestOutput, meta: StreamMeta
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed request whose first output is ``first``.

    Events the engine has already produced when one is encoded (a client slower than the
    engine, or a burst of outputs) go out in one write instead of one each; the client sees
    the same events.

    Yields:
        Encoded ``data:`` events (one or more per chunk), ending with ``data: [DONE]``.
    """
    logprobs_sent: dict[int, int] = {}
    finished: set[int] = set()
    pending: list[bytes] = []  # encoded events not yet written
    try:
        for i in range(meta.n):
            delta = {"role": "assistant", "content": ""}
            pending.append(sse(_chunk(meta, [_choice(i, delta, None, None)])))
        out = first
        while True:
            choices = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.index in finished:
                    continue
                logprobs = None
                if meta.want_logprobs and c.logprobs:
                    start = logprobs_sent.get(c.index, 0)
                    if len(c.logprobs) > start:
                        logprobs = logprobs_body(
                            c.token_ids[start:], c.logprobs[start:], meta.token_texts
                        )
                        logprobs_sent[c.index] = len(c.logprobs)
                if c.finish_reason is not None:
                    finished.add(c.index)
                if c.text_delta or logprobs is not None or c.finish_reason is not None:
                    delta = {"content": c.text_delta} if c.text_delta else {}
                    choices.append(_choice(c.index, delta, logprobs, c.finish_reason))
            if choices:
                pending.append(sse(_chunk(meta, choices)))
            if out.finished:
                break
            ready = run.next_nowait()
            if ready is None:  # nothing more yet: write what we have, then wait
                yield b"".join(pending)
                pending.clear()
                ready = await run.next()
            out = ready
        if meta.include_usage:
            body = _chunk(meta, [])
            body["usage"] = usage_body(out)
            pending.append(sse(body))
    except APIError as exc:
        pending.append(sse(error_body(exc.status, exc.message, exc.param, exc.code)))
    finally:
        run.cancel("client_disconnected")  # a no-op once the run has finished
    pending.append(DONE)
    yield b"".join(pending)


def _choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
