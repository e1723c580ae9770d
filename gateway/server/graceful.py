"""uvicorn's server with the gateway's graceful shutdown on SIGINT / SIGTERM."""

from __future__ import annotations

from types import FrameType
from typing import Any

import uvicorn


class GracefulServer(uvicorn.Server):
    """Drains the gateway at the first SIGINT/SIGTERM, then exits normally.

    On the signal the gateway starts draining at once (new chat requests and ``/health`` get
    503) while uvicorn stops accepting connections and gives in-flight requests
    ``timeout_graceful_shutdown`` seconds; then the app's shutdown aborts the rest (their usage
    recorded as aborted) and flushes usage. uvicorn would re-raise the signal afterwards, ending
    the process by it; here ``loraplex serve`` returns and exits 0 instead.

    Args:
        config: uvicorn's config (the app, host, port, grace period).
        state: The app's :class:`gateway.server.state.GatewayState`.
    """

    def __init__(self, config: uvicorn.Config, state: Any) -> None:
        super().__init__(config)
        self.gateway_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start draining, then uvicorn's own shutdown (a second SIGINT forces it)."""
        self.gateway_state.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
