"""Handing outputs from an engine's thread to the asyncio loops that consume them.

Used by the front (``engine.client.front.AsyncLLM``), whose sink the core client calls from its
own thread (the engine thread, the ZMQ reader), and by the in-process core client's calls: each
request has an ``asyncio.Queue`` on its consumer's loop; the
engine side fills it with ``loop.call_soon_threadsafe`` (one wake-up per loop per step, not one
per output), and the consumer reads it with :func:`read_outputs`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass
class StreamState:
    """Whether a stream ended on its own (a finished output, or an error handed to it).

    A consumer that stops reading before that (client gone, cancelled) leaves ``finished``
    False, and its caller aborts the request.
    """

    finished: bool = False


async def read_outputs(queue: asyncio.Queue, state: StreamState) -> AsyncIterator[Any]:
    """Yield a request's outputs from ``queue`` until one is finished; raise an error put there.

    Raises:
        BaseException: whatever the engine side put in the queue (``ValueError`` for a refused
            request, ``EngineDeadError``, ...).
    """
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            state.finished = True
            raise item
        state.finished = item.finished
        yield item
        if state.finished:
            return


def put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On the consumer's loop: each output into its stream's queue."""
    for stream, item in items:
        stream.put_nowait(item)


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the caller's loop: complete a call's future (unless it was cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
