"""``GET /health`` and ``GET /metrics``."""

from __future__ import annotations

from litestar import Request, Response, get

from loraplex.gateway.server.errors import error_response
from loraplex.gateway.server.metrics import CONTENT_TYPE


@get("/health", exclude_from_auth=True, sync_to_thread=False)
def health(request: Request) -> Response:
    """200 ``{"status": "ok"}`` while the engine runs; 503 otherwise (or while draining)."""
    state = request.app.state.gateway
    if not state.engine.is_running:
        return error_response(503, "the engine is not running", code="engine_unavailable")
    if state.draining:
        return error_response(503, "the server is shutting down", code="shutting_down")
    return Response({"status": "ok"}, media_type="application/json")


@get("/metrics", exclude_from_auth=True, sync_to_thread=False)
def metrics(request: Request) -> Response:
    """Prometheus text exposition (CONTRACT.md names the required series)."""
    body = request.app.state.gateway.metrics.render()
    return Response(body, media_type=CONTENT_TYPE)
