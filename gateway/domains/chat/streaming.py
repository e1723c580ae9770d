"""Server-sent events for ``stream: true``: OpenAI's ``chat.completion.chunk`` sequence.

::

    data: {choices: [{index: i, delta: {role: "assistant", content: ""}}]}   one per choice
    data: {choices: [{index: i, delta: {content: "..."}, logprobs, finish_reason: null}]}
    ...
    data: {choices: [{index: i, delta: {content: "..."}, finish_reason: "stop"}]}
    data: {choices: [], usage: {...}}          only with stream_options.include_usage
    data: [DONE]

With vLLM's ``stream_options.continuous_usage_stats`` every chunk carries the usage so far
(``completion_tokens`` counts the tokens of the chunks sent up to and including it).

A failure after the headers went out (engine death, shutdown) is sent as
``data: {"error": {...}}`` before ``[DONE]``, which the ``openai`` SDK raises as an APIError.
The last write (the final chunks and ``[DONE]``) waits until the request's usage row is
durable (``ChatRun.durable``); if it cannot be made durable, an error event (503
``usage_unavailable``) goes before ``[DONE]``.
When the client goes away, the run's client watcher (``ChatRun.watch_client``) cancels the run,
which aborts the engine request and records the usage as ``aborted``; the generator then ends
with the error event, which nobody reads. If the generator is closed early (the server shutting
down), its ``finally`` cancels the run the same way.

Over ``LimitedHttpProtocol`` (``serve``), the run defers its ``ok`` row (``ChatRun.deliver``):
before the last write the stream waits until the connection takes writes again
(``Exchange.writable``), then records the row (``ChatRun.delivered``). A client that stopped
reading is cut at the write deadline meanwhile, and its row says ``aborted``
(``write_timeout``) with every token generated: it never got the end of the answer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send

from loraplex.engine.request import RequestOutput
from loraplex.gateway.domains.chat.responses import (
    TokenBytes,
    legacy_logprobs_body,
    logprobs_body,
    usage_body,
)
from loraplex.gateway.domains.chat.service import ChatRun
from loraplex.gateway.domains.chat.tool_calls import ToolCallStreamer
from loraplex.gateway.errors import APIError, error_body

logger = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class FinalChunk(bytes):
    """The last bytes of a stream: sent with ``more_body: False`` (no empty closing write)."""


class _EventStreamResponse(ASGIStreamingResponse):
    """Litestar's streaming response, sending the body in the handler's own task.

    Litestar's ``send_body`` runs the iterator in an anyio task group beside a listener for
    ``http.disconnect``; here the chat run watches the client itself (``ChatRun.watch_client``),
    so that machinery (a task group, a task and a cancel scope per response) is not needed.
    A :class:`FinalChunk` ends the body in the same write.
    """

    __slots__ = ()

    async def send_body(self, send: Send, receive: Receive) -> None:
        """Send each chunk as an ``http.response.body`` event (see the class docstring)."""
        ended = False
        async for chunk in self.iterator:  # to its end, so the generator finishes here
            if ended:
                raise RuntimeError("an event stream yielded after its FinalChunk")
            ended = type(chunk) is FinalChunk
            await send({"type": "http.response.body", "body": bytes(chunk), "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class EventStream(Stream):
    """A ``text/event-stream`` response over an async iterator of encoded events.

    The iterator must not need a disconnect listener (see :class:`_EventStreamResponse`).
    """

    __slots__ = ()

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIResponse:
        """Litestar's streaming response, with :class:`_EventStreamResponse`'s ``send_body``."""
        response = super().to_asgi_response(*args, **kwargs)
        response.__class__ = _EventStreamResponse  # same slots: only the methods change
        return response


@dataclass(frozen=True)
class StreamMeta:
    """What every chunk repeats, and what the stream was asked for.

    Attributes:
        response_id: ``chatcmpl-...``.
        created: Unix seconds.
        model: The model as asked.
        n: Choices.
        include_usage: Send ``usage: null`` in every chunk and a last usage chunk.
        continuous_usage: Send the usage so far in every chunk (vLLM's
            ``continuous_usage_stats``).
        tool_calls: Makes a fresh tool-call parser for a choice (None: plain text).
        text_completion: ``POST /v1/completions``: ``text_completion`` chunks whose choices
            carry ``text`` (no role chunk), legacy logprobs.
        echo: Completions' ``echo``: the prompt's text, sent first in each choice; a list:
            each choice's own (a batch of prompts), by choice index.
        echo_logprobs: With ``echo`` and ``logprobs``: per choice index, its prompt's part of
            the legacy logprobs, in the chunk that echoes the prompt (a batch of prompts: each
            choice's own prompt's).
        want_logprobs: Send each delta's logprobs.
        token_bytes: Token ids to their bytes (for logprobs).
        service_tier: The tier that serves the request (every chunk says it, as OpenAI's do).
    """

    response_id: str
    created: int
    model: str
    n: int
    include_usage: bool
    want_logprobs: bool
    token_bytes: TokenBytes
    continuous_usage: bool = False
    tool_calls: Callable[[], ToolCallStreamer | None] = lambda: None
    text_completion: bool = False
    echo: str | list[str] = ""
    echo_logprobs: list[dict[str, Any]] | None = None
    service_tier: str = "default"


def sse(obj: Any) -> bytes:
    """One ``data:`` event."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def chunk_body(meta: StreamMeta, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``chat.completion.chunk`` (or ``text_completion``) object.

    ``usage`` is null in it when the stream includes usage.
    """
    body: dict[str, Any] = {
        "id": meta.response_id,
        "object": "text_completion" if meta.text_completion else "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "service_tier": meta.service_tier,
        "choices": choices,
    }
    if meta.include_usage or meta.continuous_usage:
        body["usage"] = None
    return body


class ChunkEncoder:
    """Encodes a stream's chunks: the fields every chunk repeats are encoded once.

    ``encode(choices)`` gives the same bytes as ``sse(chunk_body(meta, choices))``: the
    ``"choices"`` value is spliced between a prefix and a suffix made from ``chunk_body``
    itself, so the two cannot drift apart.
    """

    _MARK = "\x00choices\x00"

    def __init__(self, meta: StreamMeta) -> None:
        self._meta = meta
        mark = msgspec.json.encode(self._MARK)
        template = sse(chunk_body(meta, self._MARK))  # type: ignore[arg-type]
        parts = template.split(mark)
        self._parts = parts if len(parts) == 2 else None  # the mark in the id or model: no
        if self._parts is not None:  # one content delta of choice 0: the per-token event
            choice = msgspec.json.encode([_choice(meta, 0, {"content": self._MARK}, None, None)])
            before, after = choice.split(mark)
            self._content0 = (self._parts[0] + before, after + self._parts[1])

    def encode(self, choices: list[dict[str, Any]]) -> bytes:
        """The ``data:`` event of a chunk with these choices."""
        if self._parts is None:
            return sse(chunk_body(self._meta, choices))
        return self._parts[0] + msgspec.json.encode(choices) + self._parts[1]

    def content0(self, text: str) -> bytes:
        """The event of one content delta of choice 0, with only ``text`` encoded per call.

        The same bytes as ``encode([{"index": 0, "delta": {"content": text}, "logprobs": None,
        "finish_reason": None}])``: the event of almost every token of a stream.
        """
        if self._parts is None:
            return self.encode([_choice(self._meta, 0, {"content": text}, None, None)])
        return self._content0[0] + msgspec.json.encode(text) + self._content0[1]


async def drain(
    run: ChatRun,
    first: RequestOutput,
    pending: list[bytes],
    handle: Callable[[RequestOutput], None],
    writable: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[bytes]:
    """Feed a run's outputs to ``handle``, writing what it encoded whenever the engine pauses.

    The stream loop of every streamed endpoint (Chat Completions, Completions, the Responses
    API's events): ``handle(out)`` appends the encoded events of each output to ``pending``;
    events the engine has already produced when one is handled (a client slower than the
    engine, a burst of outputs) go out in one write instead of one each. After the last
    output, with ``writable`` given, the run is recorded delivered once the connection takes
    writes (``ChatRun.deliver``), or client-gone (``aborted``) when it does not. What is still
    in ``pending`` then (the last output's events) is the caller's to write, with its ending.

    Args:
        run: The chat run.
        first: Its first output.
        pending: Encoded events not yet written (the caller's list, appended to by ``handle``;
            cleared here after each write).
        handle: Encodes one output into ``pending`` (it may raise ``APIError``: the caller's
            ``try`` ends the stream with it).
        writable: ``Exchange.writable``, or None.

    Yields:
        Joined bytes of ``pending``, each time the engine has nothing more ready.
    """
    out = first
    while True:
        handle(out)
        if out.finished:
            break
        ready = run.next_nowait()
        if ready is None:  # nothing more yet: write what we have, then wait
            yield b"".join(pending)
            pending.clear()
            ready = await run.next()
        out = ready
    if writable is not None:  # the run's "ok" row waits for this (ChatRun.deliver)
        if await writable():
            run.delivered()
        else:
            run.client_gone()  # cut before the last write: aborted, not delivered


async def chunk_stream(
    run: ChatRun,
    first: RequestOutput,
    meta: StreamMeta,
    writable: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed request whose first output is ``first``.

    Outputs are read by :func:`drain` (bursts go out in one write; the client sees the same
    events).

    The last write, with the finish chunks and ``data: [DONE]``, waits for ``run.durable()``.

    Args:
        run: The chat run.
        first: Its first output.
        meta: What every chunk repeats.
        writable: Waits until the connection takes writes; False when the client is gone
            (``Exchange.writable``). Given, the finished run is recorded (``run.delivered``)
            only once it returns True, just before the last write; else ``aborted``.

    Yields:
        Encoded ``data:`` events (one or more per chunk), ending with ``data: [DONE]``.
    """
    finished: set[int] = set()
    parsers = _Parsers(meta.tool_calls)
    pending: list[bytes] = []  # encoded events not yet written
    failed: APIError | None = None
    encoder = ChunkEncoder(meta)
    ledger = run.ledger
    completion_tokens = 0

    def encode(choices: list[dict[str, Any]]) -> bytes:
        if not meta.continuous_usage:
            return encoder.encode(choices)
        body = chunk_body(meta, choices)
        body["usage"] = usage_body(ledger.prompt_tokens, completion_tokens, ledger.cached_tokens)
        return sse(body)

    try:
        for i in range(meta.n):
            if meta.text_completion:  # no role; the echoed prompt opens each choice
                echo = meta.echo if isinstance(meta.echo, str) else meta.echo[i]
                if echo:
                    lp = None if meta.echo_logprobs is None else meta.echo_logprobs[i]
                    echoed = _choice(meta, i, {"content": echo}, lp, None)
                    pending.append(encode([echoed]))
                continue
            delta = {"role": "assistant", "content": ""}
            pending.append(encode([_choice(meta, i, delta, None, None)]))
        plain = meta.n == 1 and not meta.want_logprobs and not meta.continuous_usage
        plain = plain and not parsers.active

        def handle(out: RequestOutput) -> None:
            nonlocal completion_tokens
            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            only = out.outputs[0] if len(out.outputs) == 1 else None
            if plain and only is not None and only.index == 0 and only.finish_reason is None:
                if only.text:  # the per-token event: only the text is encoded
                    pending.append(encoder.content0(only.text))
            else:
                choices = _choices(out, meta, finished, parsers)
                if choices:
                    pending.append(encode(choices))

        async for written in drain(run, first, pending, handle, writable):
            yield written
        if meta.include_usage:
            body = chunk_body(meta, [])  # the ledger closed before the last output came
            body["usage"] = usage_body(
                ledger.prompt_tokens, ledger.completion_tokens, ledger.cached_tokens
            )
            pending.append(sse(body))
    except APIError as exc:
        failed = exc
        pending.append(sse(error_body(exc.status, exc.message, exc.param, exc.code)))
    except Exception:  # a bug encoding this stream: it ends with an error event, alone
        logger.exception("streaming %s failed", meta.response_id)
        pending.append(sse(error_body(500, "internal server error", None, "internal_error")))
    finally:
        run.cancel("client_disconnected")  # a no-op once the run has finished
    try:
        await run.durable(strict=failed is None)
    except APIError as exc:  # not durable: the client must not take the answer as complete
        pending.append(sse(error_body(exc.status, exc.message, exc.param, exc.code)))
    pending.append(DONE)
    yield FinalChunk(b"".join(pending))


class _Parsers:
    """One tool-call parser per choice index, made on first use."""

    def __init__(self, make: Callable[[], ToolCallStreamer | None]) -> None:
        self._make = make
        self._by_index: dict[int, ToolCallStreamer | None] = {}
        self.active = make() is not None

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The chunk delta for a choice's new text, and its (possibly renamed) finish."""
        if not self.active:
            return ({"content": text} if text else {}), finish
        if index not in self._by_index:
            self._by_index[index] = self._make()
        parser = self._by_index[index]
        deltas = parser.feed(text)
        if finish is not None:
            last, finish = parser.finish(finish)
            deltas += last
        merged: dict[str, Any] = {}
        for d in deltas:
            if d.get("content"):
                merged["content"] = merged.get("content", "") + d["content"]
            if d.get("tool_calls"):
                merged.setdefault("tool_calls", []).extend(d["tool_calls"])
        return merged, finish


def _choices(
    out: RequestOutput, meta: StreamMeta, finished: set[int], parsers: _Parsers
) -> list[dict[str, Any]]:
    """The chunk's choices for a ``DELTA`` output: each unfinished choice's text, logprobs, finish.

    Updates ``finished`` (choices whose finish reason was sent).
    """
    choices = []
    ordered = out.outputs if len(out.outputs) == 1 else sorted(out.outputs, key=_index)
    for c in ordered:
        if c.index in finished:
            continue
        logprobs = None
        if meta.want_logprobs and c.logprobs:
            body_of = legacy_logprobs_body if meta.text_completion else logprobs_body
            logprobs = body_of(c.token_ids, c.logprobs, meta.token_bytes)
        if c.finish_reason is not None:
            finished.add(c.index)
        delta, finish = parsers.delta(c.index, c.text, c.finish_reason)
        if delta or logprobs is not None or finish is not None:
            choices.append(_choice(meta, c.index, delta, logprobs, finish))
    return choices


def _index(choice: Any) -> int:
    return choice.index


def _choice(
    meta: StreamMeta,
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish: str | None,
) -> dict[str, Any]:
    if meta.text_completion:
        text = delta.get("content", "")
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
