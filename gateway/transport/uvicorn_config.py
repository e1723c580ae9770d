"""The uvicorn configuration ``serve`` runs: httptools with the transport limits, the cap fitted."""

from __future__ import annotations

import dataclasses
import logging
import resource
from typing import Any

import uvicorn

from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.transport.http_protocol import limited_protocol
from loraplex.gateway.transport.limits import TransportLimits

logger = logging.getLogger("loraplex.transport")

FD_RESERVE = 256  # descriptors kept for the database pool, model and adapter files, logs


def fit_connection_cap(max_connections: int, reserve: int = FD_RESERVE) -> int:
    """``max_connections``, lowered where the process may not open that many files.

    Raises the soft ``RLIMIT_NOFILE`` towards the hard one when it is short (what Go's runtime
    does at start-up); if it is still short, the cap becomes ``soft - reserve`` (logged).

    Returns:
        The connection cap to use (at least 1).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, soft - reserve)
        logger.warning(
            "max_connections lowered from %d to %d: the process may open %d files",
            max_connections,
            cap,
            soft,
        )
        return cap
    return max_connections


def uvicorn_config(app: Any, config: GatewayConfig, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration for the gateway ``app`` under ``config``.

    httptools with :class:`TransportLimits` (an explicit class: uvicorn's h11 fallback, which
    has none of these limits, is never chosen), no websockets (no route takes one), and
    ``X-Forwarded-For`` / ``X-Forwarded-Proto`` believed only from ``config.forwarded_allow_ips``
    (none by default: the peer address is the client's, for the failed-auth throttle and logs).

    Args:
        app: The ASGI app.
        config: The gateway's settings (host, port, limits).
        **options: More ``uvicorn.Config`` arguments (``log_level``, ``loop``, ...).
    """
    limits = TransportLimits.of(config)
    limits = dataclasses.replace(limits, max_connections=fit_connection_cap(limits.max_connections))
    trusted = config.forwarded_allow_ips
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=limited_protocol(limits),
        ws="none",
        proxy_headers=trusted is not None,
        forwarded_allow_ips=trusted,
        **options,
    )
