"""The access log of ``loraplex serve``: one line per HTTP request, written in batches.

uvicorn's access log goes through :mod:`logging` for every request: a ``LogRecord``, filters,
a formatter that copies the record, and a write and flush of its own. In ``bench.gateway`` that
cost the event loop 75-120 us per request (a tenth of the server's CPU per chat request) and,
written from a second thread, GIL hand-overs that stretched the latency tail. Like nginx's
buffered ``access_log``, :class:`AccessLog` formats each line with one f-string when the
response ends and writes what gathered in one ``write`` per ``flush_seconds``.

Line format (uvicorn's, plus the time the request took, the request's id (the ``x-request-id``
its response carried: :mod:`gateway.transport.request_id`) and the tenant when a key named one)::

    INFO:     127.0.0.1:50412 - "GET /v1/models HTTP/1.1" 200 3.1ms request_id=9c1e... tenant=7f...

A request that ended before its response started (client gone, server stopping) shows ``-`` as
its status. The request target is logged percent-decoded, keys masked
(:func:`gateway.auth.redact.redact`) and non-printable characters escaped, so a crafted URL can
neither leak a key (encoded or not) nor forge a line.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, TextIO
from urllib.parse import unquote_plus

from loraplex.gateway.auth.redact import redact
from loraplex.gateway.transport.request_id import request_id

Scope = dict[str, Any]


class AccessLog:
    """ASGI middleware writing one access line per HTTP request (other scopes pass through).

    Args:
        app: The ASGI application.
        stream: Where lines go (default ``sys.stdout``, as uvicorn's access log).
        flush_seconds: Longest a line waits in memory before it is written.
        max_lines: Lines that trigger a write at once.

    Attributes:
        written: Lines written so far.
        dropped: Lines lost because the stream failed (closed, broken pipe).
    """

    def __init__(
        self,
        app: Any,
        stream: TextIO | None = None,
        *,
        flush_seconds: float = 0.1,
        max_lines: int = 512,
    ) -> None:
        self.app = app
        self.stream = stream if stream is not None else sys.stdout
        self.flush_seconds = flush_seconds
        self.max_lines = max_lines
        self.written = 0
        self.dropped = 0
        self._lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        """Run the app; for ``http`` scopes, log the request once it ends (raised or not)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0

        async def send_and_note_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self.add(access_line(scope, status, time.perf_counter() - start))

    def add(self, line: str) -> None:
        """Queue one line (ending in a newline); written within ``flush_seconds``."""
        self._lines.append(line)
        if len(self._lines) >= self.max_lines:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: nothing would flush later
                self.flush()
                return
            self._timer = loop.call_later(self.flush_seconds, self.flush)

    def flush(self) -> None:
        """Write the queued lines now (also at shutdown: call it after the server stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
            self.written += len(lines)
        except (OSError, ValueError):  # closed or broken stream: the lines are lost
            self.dropped += len(lines)


def access_line(scope: Scope, status: int, seconds: float) -> str:
    """The access line of one request (see the module docstring for the format).

    Args:
        scope: The request's ASGI ``http`` scope (after the app ran: ``user`` may be set).
        status: The response status; 0 when no response started.
        seconds: How long the request took.
    """
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    target = scope.get("root_path", "") + scope.get("path", "")  # percent-decoded
    query = scope.get("query_string")
    if query:
        text = query.decode("latin-1")
        target = f"{target}?{unquote_plus(text) if '%' in text or '+' in text else text}"
    target = redact(target)  # decoded first, so an encoded key is masked too
    if not target.isprintable():
        target = target.encode("unicode_escape").decode("ascii")
    tenant = getattr(scope.get("user"), "tenant_id", None)
    line = (
        f'INFO:     {where} - "{scope.get("method", "-")} {target} '
        f'HTTP/{scope.get("http_version", "1.1")}" {status or "-"} {seconds * 1e3:.1f}ms '
        f"request_id={request_id(scope)}"  # printable, no space: cannot forge a field or line
    )
    return f"{line} tenant={tenant}\n" if tenant else f"{line}\n"
