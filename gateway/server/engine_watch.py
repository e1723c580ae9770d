"""The engine watchdog: a gateway whose engine died must not sit half-dead.

``/health`` answers 503 as soon as the engine stops (it asks the engine each time). This task
polls the engine too, and when it finds it stopped while the server is not draining, it logs
once and calls ``state.on_engine_death``: ``loraplex serve`` (``GracefulServer``) then drains
and exits non-zero, so a supervisor (systemd, Docker's restart policy, Kubernetes) restarts
the whole process. Without that hook (tests, embedded use) only the log line and ``/health``
tell.

An engine core in its own process (``engine.client.process``) is restarted by its
client: while it is ``recovering`` the gateway keeps running (``/health`` answers 503); only a
client that gave up restarting counts as dead here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.gateway.server.state import GatewayState

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2


async def watch_engine(state: GatewayState, poll_seconds: float = POLL_SECONDS) -> None:
    """Return once the engine stopped (after calling ``state.on_engine_death``) or draining."""
    while not state.draining:
        if not state.engine.is_running and not getattr(state.engine, "recovering", False):
            logger.critical(
                "the engine stopped; in-flight requests failed with 503 and the server exits "
                "(non-zero) so that its supervisor restarts it"
            )
            if state.on_engine_death is not None:
                state.on_engine_death()
            return
        await asyncio.sleep(poll_seconds)
