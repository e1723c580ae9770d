"""The metrics listener: ``GET /metrics`` without a key, on its own address, and nothing else.

``/metrics`` holds every tenant's id with its live request, token and cached-token counters
(``docs/metrics.md``), so the API port serves it only for the admin key. A scraper that should
not hold the admin key (which also creates tenants and revokes keys) reads it from the metrics
listener instead (``serve --metrics-port``): a second listening socket of the same server,
bound to ``--metrics-host`` (``127.0.0.1`` unless told otherwise, as Envoy's admin port and
Kong's status listener are), that answers ``GET`` / ``HEAD /metrics`` with no key and 404 for
every other path, so none of the API (tenant routes, ``/admin/*``, ``/docs``) is reachable
there.

Both sockets belong to one uvicorn server, one event loop and one app: :func:`split_listeners`
sends each HTTP request by the local port it arrived on (``scope["server"]``, the socket's own
address, which no client can forge) to :class:`MetricsApp` or to the API app. The ports must
differ (``serve`` refuses the same port twice).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import msgspec

from loraplex.gateway.errors import error_body
from loraplex.gateway.metrics.registry import CONTENT_TYPE
from loraplex.gateway.transport.request_id import tag_response

if TYPE_CHECKING:
    from loraplex.gateway.server.state import GatewayState

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

METRICS_PATH = "/metrics"


class MetricsApp:
    """The ASGI app of the metrics listener (see the module doc).

    Args:
        render: Makes the Prometheus text (``Metrics.render``), called per scrape on the event
            loop, as the API's ``/metrics`` route does.
    """

    def __init__(self, render: Callable[[], bytes]) -> None:
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one HTTP request: 200 with the metrics, 404 or 405 in OpenAI's error body.

        Each answer carries ``x-request-id``, as the API's do (``gateway.transport.request_id``).
        """
        if scope["type"] != "http":
            return

        async def tagged(message: MutableMapping[str, Any]) -> None:
            tag_response(message, scope)
            await send(message)

        method = scope["method"]
        if scope["path"] != METRICS_PATH:
            await _send_error(
                tagged, 404, "the metrics listener serves GET /metrics only", "not_found"
            )
        elif method not in ("GET", "HEAD"):
            await _send_error(tagged, 405, f"{method[:16]} is not allowed on /metrics", allow=True)
        else:
            body = self.render()
            headers = [
                (b"content-type", CONTENT_TYPE.encode()),
                (b"content-length", str(len(body)).encode()),
            ]
            await tagged({"type": "http.response.start", "status": 200, "headers": headers})
            await tagged({"type": "http.response.body", "body": b"" if method == "HEAD" else body})


async def _send_error(
    send: Send, status: int, message: str, code: str | None = None, allow: bool = False
) -> None:
    """An error answer in OpenAI's body (``Allow: GET, HEAD`` with a 405)."""
    body = msgspec.json.encode(error_body(status, message, code=code))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if allow:
        headers.append((b"allow", b"GET, HEAD"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def split_listeners(app: ASGIApp, state: GatewayState) -> ASGIApp:
    """``app`` as served: requests that arrive on the metrics port go to :class:`MetricsApp`.

    Args:
        app: The API app (``create_app``); it gets every other scope, lifespan included.
        state: The gateway (``config.metrics_port``: the listener's port as bound, None for
            no listener; ``metrics.render``).

    Returns:
        ``app`` itself when there is no metrics listener, else the dispatching app.
    """
    port = state.config.metrics_port
    if port is None:
        return app
    metrics = MetricsApp(state.metrics.render)

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] == port:
            await metrics(scope, receive, send)
        else:
            await app(scope, receive, send)

    return dispatch
