"""An engine core on a thread of this process, as an :class:`EngineCoreClient`.

The core's loop runs on its own thread, so a step (torch releases the GIL in its kernels) never
blocks the event loop. Requests, aborts, finishes and calls cross to the thread through a queue;
outputs go to the front's sink from that thread. No tokenizer here: token ids in and out. The
in-process gateway (``serve --in-process``, the tests) and ``AsyncLLM.in_process`` use it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from loraplex.engine.client.core_client import (
    EngineCoreClient,
    FinishRequest,
    OutputSink,
    core_info,
)
from loraplex.engine.client.streams import settle
from loraplex.engine.errors import EngineDeadError, RequestFailedError, rejection_error
from loraplex.engine.request import EngineRequest

logger = logging.getLogger(__name__)


class InprocCoreClient(EngineCoreClient):
    """An ``EngineCore`` stepped on a background thread.

    Args:
        engine_core: The core (``engine.core.engine_core.EngineCore``).
        owns_core: Stop the core's helpers (its grammar sandbox) when this client stops; an
            engine shared with others (tests) is left running.

    Attributes:
        engine_core: The core, for benchmarks and tests (nothing above the interface reads it).
    """

    def __init__(self, engine_core: Any, *, owns_core: bool = True) -> None:
        self.engine_core = engine_core
        self.config = engine_core.config
        self.info = core_info(engine_core)
        self._owns_core = owns_core
        self._sink: OutputSink | None = None
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._kv_events: collections.deque = collections.deque()  # filled by the engine thread
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)

    def set_sink(self, sink: OutputSink) -> None:
        """See :class:`EngineCoreClient`; the engine thread starts here."""
        self._sink = sink
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    # --------------------------------------------------------------------- public API
    @property
    def is_running(self) -> bool:
        """True while the engine loop is alive."""
        return self._thread.is_alive() and self._dead is None

    def add_request(self, request: EngineRequest, block_hashes: Sequence[bytes] = ()) -> None:
        """See :class:`EngineCoreClient`: admitted on the engine thread before its next step."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        self._commands.put(("add", request))

    def abort(self, request_id: str) -> None:
        """See :class:`EngineCoreClient`."""
        self._commands.put(("abort", request_id))

    def finish_requests(self, finishes: list[FinishRequest]) -> None:
        """See :class:`EngineCoreClient`: at once on the engine thread, else before a step."""
        if threading.current_thread() is self._thread:
            self._finish(finishes)
        else:
            self._commands.put(("finish", finishes))

    async def add_lora(self, adapter: Any) -> None:
        """See :class:`EngineCoreClient` (runs on the engine thread between steps)."""
        core = self.engine_core
        if isinstance(adapter, str):
            await self._call(lambda digest: core.add_lora(core.adapters.load(digest)), adapter)
        else:
            await self._call(core.add_lora, adapter)

    async def remove_lora(self, digest: str) -> bool:
        """See :class:`EngineCoreClient`.

        Requests already waiting for it fail cleanly when admitted (finish reason
        ``"abort"``); no request ever switches adapter.
        """
        return await self._call(self.engine_core.remove_lora, digest)

    async def _call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine thread, between steps."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", (fn, args, loop, future)))
        return await future

    def describe(self) -> dict[str, Any]:
        """See :class:`EngineCoreClient`; ``pid`` is None (the core is this process)."""
        return {**super().describe(), "pid": None}

    def stats(self) -> dict[str, Any]:
        """A snapshot of scheduler and cache figures (read without locking: approximate)."""
        return self.engine_core.stats()

    def drain_kv_events(self) -> list[Any]:
        """See :class:`EngineCoreClient`; the engine thread moves them here after each step."""
        events = []
        while self._kv_events:
            events.append(self._kv_events.popleft())
        return events

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the loop (and the core's helpers if owned)."""
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._owns_core and self._dead is None:  # never started
            self._dead = EngineDeadError("the engine was shut down")
            self.engine_core.shutdown()

    # -------------------------------------------------------------------- engine thread
    def _finish(self, finishes: list[FinishRequest]) -> None:
        for f in finishes:
            self.engine_core.finish_request(f.request_id, f.reason, f.stop_reason, f.index)

    def _drain(self, block: bool) -> None:
        core = self.engine_core
        try:
            cmd, arg = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                try:
                    core.add_request(arg)
                except ValueError as exc:
                    self._sink.on_error(arg.request_id, exc)
                except Exception as exc:  # a fault in this request's admission: its alone
                    logger.exception("admitting request %s failed", arg.request_id)
                    self._sink.on_error(arg.request_id, RequestFailedError(type(exc).__name__))
            elif cmd == "call":
                fn, args, loop, future = arg
                try:
                    result, error = fn(*args), None
                except Exception as exc:  # handed to the caller
                    result, error = None, exc
                loop.call_soon_threadsafe(settle, future, result, error)
            elif cmd == "abort":
                try:
                    core.abort_request(arg)
                except Exception:  # the request is gone either way; the engine goes on
                    logger.exception("aborting request %s failed", arg)
            elif cmd == "finish":
                self._finish(arg)
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        core = self.engine_core
        try:
            while not self._stop.is_set():
                self._drain(block=not core.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if core.has_unfinished_requests():
                    outputs = core.step()
                    if outputs:
                        self._sink.on_outputs(outputs)
                    for rid, message, kind in core.take_rejected():
                        self._sink.on_error(rid, rejection_error(message, kind))
                self._kv_events.extend(core.drain_kv_events())
        except BaseException as exc:  # a bug in a step: fail every stream, mark dead
            logger.exception("engine loop failed")
            self._dead = exc
        finally:
            for rid in list(core.scheduler.requests):
                try:
                    core.abort_request(rid)
                except Exception:  # a broken engine: its streams still end below
                    logger.exception("aborting request %s failed", rid)
            try:
                if self._owns_core:
                    core.shutdown()
            except Exception:  # noqa: BLE001 - the streams must still end below
                logger.exception("shutting the engine's helpers down failed")
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
            self._fail_calls()
            self._sink.on_dead(EngineDeadError(str(self._dead)))

    def _fail_calls(self) -> None:
        """Calls queued behind the end of the loop fail with ``EngineDeadError``."""
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "call":
                _, _, loop, future = arg
                try:
                    loop.call_soon_threadsafe(
                        settle, future, None, EngineDeadError("the engine was shut down")
                    )
                except RuntimeError:
                    pass
