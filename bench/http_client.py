"""A lean HTTP/1.1 keep-alive client for load generators: one connection, one request at a time.

``bench.gateway`` runs its clients on the same 2 cores as the server it measures, so every
microsecond the client spends is taken from the server and shows up in the latency it reports.
``aiohttp`` costs 0.35-0.6 ms of CPU per request there (session, connector, response objects,
stream reader); this client costs a few tens of microseconds: the request is encoded once, and
the response goes through ``httptools``' C parser (the one uvicorn uses) straight into a list of
body pieces. It is what C load generators such as ``wrk`` do, in Python: no redirects, no
cookies, no decompression, no proxy; status, headers and body only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httptools


class HTTPResponse:
    """One complete response.

    Attributes:
        status: The status code.
        headers: ``(name, value)`` pairs as received (bytes; names lower-cased).
        body: The whole body, de-chunked.
    """

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def header(self, name: str) -> bytes | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        key = name.lower().encode()
        for k, v in self.headers:
            if k == key:
                return v
        return None


class _Connection(asyncio.Protocol):
    """The socket side: feeds bytes to the parser and resolves the waiting request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[HTTPResponse] | None = None
        self.closed: Exception | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed response: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError("the server closed the connection") if exc is None else exc)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        response = HTTPResponse(self.parser.get_status_code(), self._headers, b"".join(self._body))
        self._headers, self._body = [], []
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _fail(self, exc: Exception) -> None:
        self.closed = exc
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class LeanHTTPClient:
    """One keep-alive HTTP/1.1 connection to ``host:port``.

    Args:
        host: Server address (IPv4 or name).
        port: Server port.
        headers: Sent with every request (e.g. ``Authorization``), besides ``Host`` and
            ``Content-Length``.

    Use :meth:`connect` first, then :meth:`encode` a request once and :meth:`send` it as often
    as needed; :meth:`close` at the end. Not for concurrent use: one request at a time.
    """

    def __init__(self, host: str, port: int, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.host = host
        self.port = port
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in headers)
        self._conn: _Connection | None = None

    async def connect(self) -> None:
        """Open the connection.

        Raises:
            OSError: the server cannot be reached.
        """
        loop = asyncio.get_running_loop()
        _, self._conn = await loop.create_connection(_Connection, self.host, self.port)

    def encode(
        self, method: str, path: str, body: bytes = b"", content_type: str | None = None
    ) -> bytes:
        """The request's bytes, to pass to :meth:`send` (any number of times)."""
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._headers}"
        if content_type is not None:
            head += f"Content-Type: {content_type}\r\n"
        if body or method not in ("GET", "HEAD"):
            head += f"Content-Length: {len(body)}\r\n"
        return head.encode("latin-1") + b"\r\n" + body

    async def send(self, request: bytes) -> HTTPResponse:
        """Send one encoded request and wait for its whole response.

        Raises:
            ConnectionError: not connected, the server closed the connection, or the response
                was not valid HTTP.
            RuntimeError: a request is already waiting on this connection.
        """
        conn = self._conn
        if conn is None or conn.transport is None:
            raise ConnectionError("not connected: call connect() first")
        if conn.closed is not None:
            raise ConnectionError("the connection is closed") from conn.closed
        if conn.waiter is not None:
            raise RuntimeError("one request at a time on a connection")
        waiter = conn.waiter = asyncio.get_running_loop().create_future()
        conn.transport.write(request)
        return await waiter

    async def request(
        self, method: str, path: str, body: bytes = b"", content_type: str | None = None
    ) -> HTTPResponse:
        """:meth:`encode` then :meth:`send`."""
        return await self.send(self.encode(method, path, body, content_type))

    async def close(self) -> None:
        """Close the connection (a no-op when not connected)."""
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()
            await asyncio.sleep(0)  # let connection_lost run
