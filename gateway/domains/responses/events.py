"""``stream: true`` on ``POST /v1/responses``: OpenAI's Responses stream events.

::

    event: response.created      data: {type, sequence_number: 0, response: {status: "in_progress"}}
    event: response.in_progress  data: {..., response}
    ... the output items' events (``output.OutputBuilder``) ...
    event: response.completed    data: {..., response: {status: "completed", output, usage}}
                                 (``response.incomplete`` when ``max_output_tokens`` cut it)

A failure after the first event (engine death, shutdown, the usage row or the stored
response not made durable) ends the stream with an ``error`` event ``{code, message, param}``
and ``response.failed`` (its ``response.error`` says why, with OpenAI's ``server_error``,
``rate_limit_exceeded`` or ``invalid_prompt`` as the code: the ``error`` event has ours).
No ``data: [DONE]`` follows: OpenAI sends none on this API.

As for chat streams (``gateway.domains.chat.streaming.chunk_stream``, whose run protocol this
follows): events the engine has already produced go out in one write; the last write waits
for the usage row to be durable, and over ``LimitedHttpProtocol`` the ``ok`` row waits for the
connection to take that write (``ChatRun.delivered``). The response is stored (``store``)
before the final event, so a client that saw ``response.completed`` can retrieve it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from loraplex.engine.request import RequestOutput
from loraplex.gateway.domains.chat.service import ChatRun
from loraplex.gateway.domains.chat.streaming import FinalChunk, drain
from loraplex.gateway.domains.chat.tool_calls import ToolCallStreamer
from loraplex.gateway.domains.responses.output import OutputBuilder, response_object, usage_body
from loraplex.gateway.domains.responses.translate import Translation
from loraplex.gateway.errors import APIError

logger = logging.getLogger(__name__)


async def event_stream(
    run: ChatRun,
    first: RequestOutput,
    tr: Translation,
    response_id: str,
    parser: ToolCallStreamer | None,
    writable: Callable[[], Awaitable[bool]] | None,
    save: Callable[[dict[str, Any], OutputBuilder], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response whose first engine output is ``first``.

    Args:
        run: The chat run.
        first: Its first output.
        tr: The request.
        response_id: ``resp_...``.
        parser: The request's tool-call parser (None: plain text).
        writable: ``Exchange.writable`` (see ``chunk_stream``), or None.
        save: Stores the finished response (a no-op with ``store: false``).

    Yields:
        Encoded events; the last one as a :class:`FinalChunk`.
    """
    created = int(time.time())
    builder = OutputBuilder(parser, events=True)
    pending = [
        builder.event(
            "response.created",
            response=response_object(tr, response_id, created, "in_progress", []),
        ),
        builder.event(
            "response.in_progress",
            response=response_object(tr, response_id, created, "in_progress", []),
        ),
    ]
    failed: APIError | None = None
    finish: str | None = None
    ledger = run.ledger

    def handle(out: RequestOutput) -> None:
        nonlocal finish
        choice = out.outputs[0] if out.outputs else None
        if choice is not None:
            finish = choice.finish_reason
            pending.extend(builder.feed(choice.text, finish))

    try:
        async for written in drain(run, first, pending, handle, writable):  # chat's stream loop
            yield written
    except APIError as exc:
        failed = exc
    except Exception:  # a bug encoding this stream: it ends failed, alone
        logger.exception("streaming %s failed", response_id)
        failed = APIError(500, "internal server error", code="internal_error")
    finally:
        run.cancel("client_disconnected")  # a no-op once the run has finished
    try:
        await run.durable(strict=failed is None)
    except APIError as exc:
        failed = failed or exc
    usage = usage_body(ledger.prompt_tokens, ledger.completion_tokens, ledger.cached_tokens)
    incomplete = "max_output_tokens" if finish == "length" else None
    if failed is None:
        status = "incomplete" if incomplete else "completed"
        body = response_object(
            tr, response_id, created, status, builder.output, usage, incomplete=incomplete
        )
        try:
            await save(body, builder)
        except Exception as exc:  # the database: the answer is billed, but not stored
            logger.warning("storing response %s failed: %r", response_id, exc)
            failed = APIError(503, "the response could not be stored", code="database_unavailable")
        else:
            kind = "response.incomplete" if incomplete else "response.completed"
            pending.append(builder.event(kind, response=body))
    if failed is not None:
        pending.append(
            builder.event("error", code=failed.code, message=failed.message, param=failed.param)
        )
        error = {"code": _failed_code(failed.status), "message": failed.message}
        body = response_object(
            tr, response_id, created, "failed", builder.output, usage, error=error
        )
        pending.append(builder.event("response.failed", response=body))
    yield FinalChunk(b"".join(pending))


def _failed_code(status: int) -> str:
    """``response.error.code``: one of OpenAI's codes (the ``error`` event has ours)."""
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_prompt"
