"""A TCP forwarder on loopback that can be cut: a database outage without stopping the database.

Stopping a shared PostgreSQL would take every other test's database down with it; pointing the
server at this proxy instead and calling :meth:`TcpProxy.cut` closes the listening socket (new
connections are refused) and every connection open through it (as a server crash does), while
the database itself keeps running. :meth:`TcpProxy.restore` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` from a background thread.

    Args:
        target_host: Where to forward to.
        target_port: Its port.

    Attributes:
        port: The proxy's own port (fixed for its whole life).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def url_for(self, url: str) -> str:
        """``url`` (a SQLAlchemy URL of the target) pointed at the proxy instead."""
        from sqlalchemy.engine import make_url

        return (
            make_url(url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def start(self) -> TcpProxy:
        """Start forwarding."""
        self._thread.start()
        self.restore()
        return self

    def restore(self) -> None:
        """Listen again (the database is back)."""
        self._call(self._listen())

    def cut(self) -> None:
        """Refuse new connections and drop every open one (the database is gone)."""
        self._call(self._cut())

    def close(self) -> None:
        """Cut and stop the thread."""
        with contextlib.suppress(Exception):
            self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, as when the server's process dies
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()
