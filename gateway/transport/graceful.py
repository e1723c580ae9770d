"""uvicorn's server with the gateway's graceful shutdown on SIGINT / SIGTERM."""

from __future__ import annotations

import gc
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from loraplex.gateway.transport.access_log import AccessLog


class GracefulServer(uvicorn.Server):
    """Drains the gateway at the first SIGINT/SIGTERM, then exits normally.

    On the signal the gateway starts draining at once (new chat requests and ``/health`` get
    503) while uvicorn stops accepting connections and gives in-flight requests
    ``timeout_graceful_shutdown`` seconds; then the app's shutdown aborts the rest (their usage
    recorded as aborted) and flushes usage. uvicorn would re-raise the signal afterwards, ending
    the process by it; here ``loraplex serve`` returns and exits 0 instead.

    If the engine dies while serving (``gateway.server.engine_watch``), it drains the same way
    and :attr:`exit_code` becomes 1, which ``loraplex serve`` exits with.

    Args:
        config: uvicorn's config (the app, host, port, grace period).
        state: The app's :class:`gateway.server.state.GatewayState`.
        on_ready: Called once the app has started and the server accepts connections.

    Attributes:
        exit_code: 0, or 1 once the engine died.
    """

    def __init__(
        self, config: uvicorn.Config, state: Any, on_ready: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config)
        self.gateway_state = state
        self.exit_code = 0
        self.on_ready = on_ready
        if hasattr(state, "on_engine_death"):
            state.on_engine_death = self.engine_died

    def engine_died(self) -> None:
        """Drain and stop with exit code 1: a supervisor restarts a process that exits."""
        self.exit_code = 1
        self.gateway_state.draining = True
        self.should_exit = True

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until the exit.

        The start-up heap is frozen first (:func:`freeze_startup_heap`); when the app is an
        :class:`~gateway.transport.access_log.AccessLog`, its last lines are written at the end.
        """
        freeze_startup_heap()
        try:
            super().run(sockets)
        finally:
            if isinstance(self.config.app, AccessLog):
                self.config.app.flush()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start as uvicorn does (the app's lifespan, then the listeners), then ``on_ready``."""
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start draining, then uvicorn's own shutdown (a second SIGINT forces it)."""
        self.gateway_state.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def freeze_startup_heap() -> int:
    """Collect the young generations, then move every object alive now out of the collector's sight.

    A serving process holds hundreds of thousands of long-lived objects from start-up (torch,
    transformers, SQLAlchemy, Litestar, the model); each full (generation 2) collection walks
    them all. Under
    load that was a 150-500 ms pause of the event loop (and of the engine thread, which needs
    the GIL) every couple of seconds in ``bench.gateway``: every in-flight request stalled at once.
    ``gc.freeze()`` (CPython 3.7+, the technique Instagram described for pre-fork servers and
    vLLM applies after start-up) puts them in a permanent generation that collections skip;
    objects made later are collected as usual.

    Only generations 0 and 1 are collected first (a millisecond): the automatic collections of
    start-up have already run, and a full collection of the ~500k objects of ``serve`` on the
    tiny model found 351 more unreachable objects for 0.5 s of CPU before the server answered
    (measured); those few stay frozen.

    Returns:
        How many objects are now frozen.
    """
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()
