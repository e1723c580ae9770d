"""``AsyncLLM``: the engine on a background thread, streaming per-request outputs to asyncio.

The engine loop runs on its own thread, so a step (torch releases the GIL in its kernels) never
blocks the event loop. Requests and aborts cross to the thread through a queue; outputs come
back with ``loop.call_soon_threadsafe``. A consumer that stops iterating (client disconnect,
cancellation) aborts its request, which frees its blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import EngineDeadError, RequestFailedError
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import EngineRequest, RequestOutput
from loraplex.engine.streams import StreamState, put_all, read_outputs, settle

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestFailedError"]


class AsyncLLM:
    """Asynchronous streaming front of :class:`LLMEngine`.

    Args:
        config: The engine configuration.
        engine: An already built engine (tests pass one to share a model), else built here;
            one passed in is left running (its grammar sandbox too) when this one stops.
    """

    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None):
        self._owns_engine = engine is None  # its helpers stop with this loop only then
        if engine is None:
            if config is None:
                raise ValueError("AsyncLLM needs a config or an engine")
            engine = LLMEngine(config)
        self.engine = engine
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._kv_events: collections.deque = collections.deque()  # filled by the engine thread
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------- public API
    @property
    def is_running(self) -> bool:
        """True while the engine loop is alive."""
        return self._thread.is_alive() and self._dead is None

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as steps produce them, the last finished.

        Raises:
            ValueError: the engine refused the request (raised at the first iteration).
            EngineDeadError: the engine loop is not running.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._streams[rid] = (loop, stream)
        self._commands.put(("add", request))
        state = StreamState()
        try:
            async for item in read_outputs(stream, state):
                yield item
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not state.finished:
                self._commands.put(("abort", rid))

    async def add_lora(self, adapter: Any) -> None:
        """Hot-add a validated adapter (runs on the engine thread between steps)."""
        await self._call(self.engine.add_lora, adapter)

    async def remove_lora(self, digest: str) -> bool:
        """Hot-remove an adapter; False (nothing changes) while a running sequence uses it.

        Requests already waiting for it fail cleanly when admitted (finish reason
        ``"abort"``); no request ever switches adapter.
        """
        return await self._call(self.engine.remove_lora, digest)

    async def _call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine thread, between steps."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", (fn, args, loop, future)))
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish reason ``"abort"``)."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the loop."""
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        """A snapshot of scheduler and cache figures (read without locking: approximate)."""
        return self.engine.stats()

    def drain_kv_events(self) -> list[Any]:
        """KV events since the last call, oldest first.

        See ``engine.kv_events``; none unless the config has ``enable_kv_events``. The engine
        thread moves them here after each step.
        """
        events = []
        while self._kv_events:
            events.append(self._kv_events.popleft())
        return events

    # -------------------------------------------------------------------- engine thread
    def _deliver(self, rid: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop, not one per output.

        Each ``call_soon_threadsafe`` writes to the loop's self-pipe and takes its lock; with
        64 streams that was 64 wake-ups of the gateway's loop per step.
        """
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _drain(self, block: bool) -> None:
        try:
            cmd, arg = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                try:
                    self.engine.add_request(arg)
                except ValueError as exc:
                    self._deliver(arg.request_id, exc)
                except Exception as exc:  # a fault in this request's admission: its alone
                    logger.exception("admitting request %s failed", arg.request_id)
                    self._deliver(arg.request_id, RequestFailedError(str(type(exc).__name__)))
            elif cmd == "call":
                fn, args, loop, future = arg
                try:
                    result, error = fn(*args), None
                except Exception as exc:  # handed to the caller
                    result, error = None, exc
                loop.call_soon_threadsafe(settle, future, result, error)
            elif cmd == "abort":
                try:
                    out = self.engine.abort_request(arg)
                except Exception:  # the request is gone either way; the engine goes on
                    logger.exception("aborting request %s failed", arg)
                    out = None
                if out is not None:
                    self._deliver(arg, out)
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver_all(self.engine.step())
                    for rid, error in self.engine.take_rejected():
                        self._deliver(rid, error)
                self._kv_events.extend(self.engine.core.drain_kv_events())
        except BaseException as exc:  # a bug in a step: fail every stream, mark dead
            logger.exception("engine loop failed")
            self._dead = exc
        finally:
            for rid in list(self.engine.output_processor.requests):
                try:
                    out = self.engine.abort_request(rid)
                except Exception:  # a broken engine: its streams still end below
                    logger.exception("aborting request %s failed", rid)
                    continue
                if out is not None:
                    self._deliver(rid, out)
            try:
                if self._owns_engine:
                    self.engine.shutdown()
            except Exception:  # noqa: BLE001 - the streams must still end below
                logger.exception("shutting the engine's helpers down failed")
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
            with self._lock:
                pending = list(self._streams)
            for rid in pending:
                self._deliver(rid, EngineDeadError(str(self._dead)))
