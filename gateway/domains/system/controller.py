"""``GET /health`` (no key) and ``GET /metrics`` (the admin key; ``docs/metrics.md``)."""

from __future__ import annotations

from litestar import Response, get

from loraplex.gateway.auth.middleware import ADMIN_ONLY
from loraplex.gateway.di import Injected
from loraplex.gateway.errors import error_response
from loraplex.gateway.metrics.registry import CONTENT_TYPE, GatewayMetrics
from loraplex.gateway.server.engine_client import EngineClient


@get("/health", exclude_from_auth=True, sync_to_thread=False)
def health(engine: Injected[EngineClient], draining: Injected[bool]) -> Response:
    """200 ``{"status": "ok"}`` while the engine runs; 503 otherwise (or while draining)."""
    if not engine.is_running:
        return error_response(503, "the engine is not running", code="engine_unavailable")
    if draining:
        return error_response(503, "the server is shutting down", code="shutting_down")
    return Response({"status": "ok"}, media_type="application/json")


@get("/metrics", opt=ADMIN_ONLY, sync_to_thread=False)
def metrics(metrics: Injected[GatewayMetrics]) -> Response:
    """Prometheus text exposition (docs/metrics.md lists the series); the admin key only.

    It shows every tenant's id and counters, so a tenant key gets 403 and no key 401 (counted
    by the failed-authentication throttle). A scraper without the admin key reads the metrics
    listener (``serve --metrics-port``; :mod:`gateway.server.metrics_listener`).
    """
    body = metrics.render()
    return Response(body, media_type=CONTENT_TYPE)
