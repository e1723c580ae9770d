"""The HTTP protocol ``serve`` runs: uvicorn's httptools one with the gateway's transport limits.

:class:`LimitedHttpProtocol` hooks uvicorn's own parser callbacks and protocol methods, each
calling uvicorn's implementation; :class:`PauseClock` is uvicorn's flow control, timing the
pauses that must not count against a client's deadlines. Each request's :class:`Exchange`
rides in its ASGI scope (``scope["extensions"]["loraplex.exchange"]``, :func:`exchange_of`):
through it the app names the key a connection serves and learns when its response has been
written or cut. The limits, the connection table and uvicorn's configuration live in
:mod:`gateway.transport.limits`, :mod:`gateway.transport.connections` and
:mod:`gateway.transport.uvicorn_config`.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import socket
import struct
import termios
from collections import deque
from collections.abc import Callable, MutableMapping
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from loraplex.gateway.errors import error_body
from loraplex.gateway.transport.connections import ConnectionTable
from loraplex.gateway.transport.limits import TransportLimits
from loraplex.gateway.transport.request_id import new_id, request_id

_IDLE, _HEAD, _BODY = 0, 1, 2  # between requests; reading a head; reading a body
EXCHANGE = "loraplex.exchange"  # the key of a request's Exchange in scope["extensions"]
_LINGER_ZERO = struct.pack("ii", 1, 0)
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # Linux's SIOCOUTQ: a socket's unacknowledged bytes
logger = logging.getLogger("loraplex.transport")


class PauseClock(FlowControl):
    """uvicorn's flow control, also adding up how long reading was paused (by the server).

    Args:
        transport: The connection's transport.
        clock: The event loop's clock (seconds).
    """

    def __init__(self, transport: asyncio.Transport, clock: Callable[[], float]) -> None:
        super().__init__(transport)
        self._clock = clock
        self._paused_at = 0.0
        self._paused_total = 0.0

    def pause_reading(self) -> None:
        """As uvicorn's; the pause's start is noted."""
        if not self.read_paused:
            self._paused_at = self._clock()
        super().pause_reading()

    def resume_reading(self) -> None:
        """As uvicorn's; the pause's length is added up."""
        if self.read_paused:
            self._paused_total += self._clock() - self._paused_at
        super().resume_reading()

    def paused_seconds(self) -> float:
        """Seconds reading has been paused on this connection so far."""
        if self.read_paused:
            return self._paused_total + self._clock() - self._paused_at
        return self._paused_total


class Exchange:
    """One request and its response on a :class:`LimitedHttpProtocol` connection.

    The protocol puts it in the request's ASGI scope (:func:`exchange_of`); the app uses it to
    tell the connection table which API key the connection serves (:meth:`serve_key`), to run
    code once the response has been written or the connection cut (:meth:`on_written`: the
    chat controller gives its key's concurrency slot back there), and to wait until the client
    takes writes again (:meth:`writable`).

    A response counts as **written** once its last byte has been handed to the transport and
    the transport's buffer is below its high-water mark (uvicorn's flow control: at most
    64 KiB still in this process), or, when writing was paused then, once it drained below the
    low-water mark; it is **cut** when the connection is lost first (closed by the client,
    reset at the write deadline, evicted).

    ``scope["extensions"]`` is where the ASGI specification lets a server hand an app what
    the protocol does not carry (as ``http.response.trailers`` or ``http.response.pathsend``
    are advertised there).
    """

    __slots__ = ("_protocol", "_callbacks", "done", "lost", "cut_reason")

    def __init__(self, protocol: LimitedHttpProtocol) -> None:
        self._protocol: LimitedHttpProtocol | None = protocol
        self._callbacks: list[Callable[[], None]] = []
        self.done = False  # written or cut
        self.lost = False  # cut: the connection was lost first
        self.cut_reason: str | None = None  # "write_timeout", "evicted_stalled", ...; see lost

    def serve_key(self, key_id: str) -> bool:
        """Count the connection as serving ``key_id`` (``ConnectionTable.claim``).

        Returns:
            False when the key already holds its share of the connection table and none of
            its connections is idle (the app answers 429); True otherwise (also once done).
        """
        protocol = self._protocol
        if protocol is None:
            return True
        return protocol.table.claim(protocol, key_id, protocol.loop.time())

    def on_written(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the response is written or cut (at once if it already is).

        Callbacks run on the event loop, in the order given; one that raises is logged.
        """
        if self.done:
            callback()
        else:
            self._callbacks.append(callback)

    async def writable(self) -> bool:
        """Wait until the transport takes writes (not paused by flow control).

        Returns:
            True when the next write goes out at once; False when the connection is gone or
            closing (the response will never be read whole).
        """
        protocol = self._protocol
        if protocol is None or self.lost:
            return not self.lost
        await protocol.flow.drain()
        return not self.lost and not protocol.transport.is_closing()

    def finish(self, lost: bool) -> None:
        """The response is written (``lost`` False) or cut: run the callbacks, once."""
        if self.done:
            return
        self.done = True
        self.lost = lost
        protocol, self._protocol = self._protocol, None  # no cycle through the scope
        if lost and protocol is not None:
            self.cut_reason = protocol.cut_reason
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one callback's bug must not keep the others from running
                logger.exception("a callback of a finished response failed")


def exchange_of(scope: MutableMapping[str, Any]) -> Exchange | None:
    """The :class:`Exchange` of a request's ASGI scope; None when the server is not ours."""
    extensions = scope.get("extensions")
    return None if extensions is None else extensions.get(EXCHANGE)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits :mod:`gateway.transport` describes.

    Use the subclass :func:`limited_protocol` makes: it binds
    ``limits`` and one server's ``table``.

    Attributes:
        key_id: The API key the connection last served (``Exchange.serve_key``), or None.
        cut_reason: Why the server cut the connection (``write_timeout``, ``evicted``,
            ``evicted_stalled``), or None.
    """

    limits: ClassVar[TransportLimits]
    table: ClassVar[ConnectionTable]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _HEAD
        self._timer: asyncio.TimerHandle | None = None
        self._head_started = 0.0  # loop time of the head's first byte
        self._head_paused = 0.0  # flow.paused_seconds() then
        self._head_raw = 0  # bytes read while the head was incomplete
        self._head_begun = False  # the parser began the head being read (on_message_begin)
        self._body_started = 0.0
        self._body_paused = 0.0
        self._body_bytes = 0
        self._refusal: tuple[int, str, str] | None = None  # status, message, reason
        self._counted = False  # in table.open
        self._exchanges: deque[Exchange] = deque()  # requests whose response is not complete
        self._flushing: list[Exchange] = []  # complete, waiting for the buffer to drain
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_paused_at = 0.0  # loop time writing was paused (flow control)
        self._write_paused_size = 0  # the transport's buffered bytes then
        self.key_id: str | None = None
        self.cut_reason: str | None = None

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection (making room, or refusing it, at the cap); start its head clock."""
        super().connection_made(transport)
        self.flow = PauseClock(transport, self.loop.time)  # uvicorn's, timing its pauses
        table = self.table
        now = self.loop.time()
        if table.open >= table.max_connections:
            reason = "evicted"
            victim = table.oldest_waiting()
            if victim is None:  # then a writer the client has left unread the longest
                reason = "evicted_stalled"
                victim = table.oldest_stalled(now - self.limits.stalled_after)
            if victim is None:
                table.record("connection_limit", now)
                self._answer(503, "too many open connections; retry later", "connection_limit")
                return
            table.record(reason, now)
            victim._drop(reason)
        table.open += 1
        self._counted = True
        table.wait(self)
        self._head_started = now
        self._head_paused = 0.0
        self._timer = self.loop.call_at(now + self.limits.header_timeout, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and its timers; every response not yet written is cut."""
        self._drop_accounting()
        super().connection_lost(exc)
        cut = [*self._flushing, *self._exchanges]
        self._flushing.clear()
        self._exchanges.clear()
        for exchange in cut:
            exchange.finish(lost=True)

    def _drop_accounting(self) -> None:
        self._cancel_timer()
        self._cancel_write_timer()
        table = self.table
        table.busy(self)
        table.unstall(self)
        table.unkey(self)
        if self._counted:
            self._counted = False
            table.open -= 1

    def _drop(self, reason: str = "evicted") -> None:
        """Close (evicted for a newcomer): idle, or a writer its client has stopped reading.

        A connection with bytes still unsent is reset (:meth:`_reset`), not closed: a close
        would wait for the client to read them.
        """
        self._drop_accounting()
        self._refusal = (0, "", reason)
        self.cut_reason = reason
        if self.flow.write_paused or self.transport.get_write_buffer_size():
            self._reset()
        elif not self.transport.is_closing():
            self.transport.close()

    def _reset(self) -> None:
        """Drop the connection now with a TCP reset, discarding what the client has not read.

        ``SO_LINGER`` 0 before closing, as nginx's ``reset_timedout_connection``: the kernel
        frees the socket and its send buffer at once instead of keeping an orphan that waits
        on a client which never reads. The app sees the client gone (``http.disconnect``).
        """
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
            except OSError:  # already closed, or not a TCP socket: a plain abort then
                pass
        self.transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # ----------------------------------------------------------------------- writes
    def pause_writing(self) -> None:
        """As uvicorn's (its sends wait), and the write deadline starts; a stalled writer now.

        The transport calls it when its buffer passes the high-water mark (64 KiB): the
        client is not taking the response as fast as it is written.
        """
        super().pause_writing()
        now = self.loop.time()
        self._write_paused_at = now
        self._write_paused_size = self._unsent()
        if self._counted:
            self.table.stall(self, now)
        if self._write_timer is None:
            self._write_timer = self.loop.call_at(
                now + self.limits.write_timeout, self._write_timed_out
            )

    def resume_writing(self) -> None:
        """As uvicorn's; the deadline is off, and responses complete meanwhile are written."""
        super().resume_writing()
        self._cancel_write_timer()
        self.table.unstall(self)
        flushing, self._flushing = self._flushing, []
        for exchange in flushing:
            exchange.finish(lost=False)

    def _unsent(self) -> int:
        """Bytes written and not yet taken by the client.

        The transport's buffer, plus (Linux) the kernel's send queue, whose bytes leave it as
        the client acknowledges them (``SIOCOUTQ``). The transport's buffer alone moves in
        steps of up to a third of the kernel's send buffer (the kernel wakes a writer only
        when that much is free; several MB on loopback), so a client reading steadily would
        look stalled.
        """
        unsent = self.transport.get_write_buffer_size()
        if _OUTQ is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:
                    raw = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
                    unsent += struct.unpack("i", raw)[0]
                except (OSError, ValueError):  # closed, or not a TCP socket
                    pass
        return unsent

    def _write_deadline(self) -> float:
        """When a paused write is cut: ``write_timeout`` plus the bytes taken / min rate."""
        limits = self.limits
        taken = max(0, self._write_paused_size - self._unsent())
        extra = taken / limits.write_min_rate if limits.write_min_rate > 0 else 0.0
        return self._write_paused_at + limits.write_timeout + extra

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if not self.flow.write_paused or self.cut_reason is not None:
            return
        deadline = self._write_deadline()
        if self.loop.time() < deadline:  # the client took bytes meanwhile, at the min rate
            self._write_timer = self.loop.call_at(deadline, self._write_timed_out)
            return
        self.cut_reason = "write_timeout"
        self.table.record("write_timeout", self.loop.time())
        self._reset()

    # ------------------------------------------------------------------------ reads
    def data_received(self, data: bytes) -> None:
        """Feed the parser (uvicorn's), counting head bytes and arming a deadline if needed."""
        if self._refusal is not None:
            return  # refused: nothing more is read
        if self._phase == _IDLE:
            self._phase = _HEAD
            self._head_started = self.loop.time()
            self._head_paused = self.flow.paused_seconds()
        if self._phase == _HEAD:
            self._head_raw += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse()
            else:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self._answer(400, msg, "invalid_http_request")  # uvicorn's, in OpenAI's body
            return
        if self._phase == _HEAD:
            if self._head_raw > self.limits.max_head_raw_bytes:
                self._refusal = (431, "request header fields too large", "header_too_large")
                self._refuse()
                return
            if self._head_begun and len(self.headers) > self.limits.max_headers:
                try:
                    self._check_head()  # what an incomplete head holds so far
                except _Refused:
                    self._refuse()
                    return
            if self._timer is None:
                self._timer = self.loop.call_at(self._head_deadline(), self._timed_out)
        elif self._phase == _BODY and self._timer is None:
            self._timer = self.loop.call_at(self._body_deadline(), self._timed_out)

    def on_message_begin(self) -> None:
        """As uvicorn's, and a fresh head count (its clock runs from here at the latest)."""
        super().on_message_begin()
        if self._phase == _IDLE:  # began in the read that ended the previous request
            self._phase = _HEAD
            self._head_started = self.loop.time()
            self._head_paused = self.flow.paused_seconds()
        self._head_begun = True

    def _check_head(self) -> None:
        """Refuse (431) a head past ``max_header_bytes`` or ``max_headers`` so far.

        Called when a head completes, and after a read that left an incomplete head with too
        many fields (its bytes are bounded by ``max_head_raw_bytes`` meanwhile). Not per header
        field: a Python call per field cost about as much as all the rest of the limits.

        Raises:
            _Refused: the head is refused (``_refusal`` set; raised through the parser).
        """
        limits = self.limits
        headers = self.headers or ()
        size = len(self.url)
        for name, value in headers:
            size += len(name) + len(value)
        if size > limits.max_header_bytes:
            message = f"request header fields too large (more than {limits.max_header_bytes} bytes)"
        elif len(headers) > limits.max_headers:
            message = f"too many request header fields (more than {limits.max_headers})"
        else:
            return
        self._refusal = (431, message, "header_too_large")
        raise _Refused

    def on_headers_complete(self) -> None:
        """The head is in: checked, its clock stops, the body's starts, the app runs (uvicorn's).

        The request's :class:`Exchange` joins its scope here.
        """
        self._check_head()
        exchange = Exchange(self)
        self._exchanges.append(exchange)
        self.scope.setdefault("extensions", {})[EXCHANGE] = exchange  # type: ignore[typeddict-item]
        self._head_begun = False
        self._cancel_timer()
        self.table.busy(self)
        self._phase = _BODY
        self._head_raw = 0
        self._body_started = self.loop.time()
        self._body_paused = self.flow.paused_seconds()
        self._body_bytes = 0
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        """As uvicorn's, counting the bytes that extend the body deadline."""
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        """The request is read: no deadline until the next request's first byte."""
        self._cancel_timer()
        self._phase = _IDLE
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """As uvicorn's; the response is written (or waits for the buffer to drain).

        A connection with no request left running may be evicted again.
        """
        if self._exchanges:  # responses complete in their requests' order (HTTP/1.1)
            exchange = self._exchanges.popleft()
            if self.flow.write_paused:
                self._flushing.append(exchange)
            else:
                exchange.finish(lost=False)
        super().on_response_complete()
        if (
            self._counted
            and not self.transport.is_closing()
            and (self.cycle is None or self.cycle.response_complete)
        ):
            self.table.wait(self)

    # -------------------------------------------------------------------- deadlines
    def _head_deadline(self) -> float:
        paused = self.flow.paused_seconds() - self._head_paused
        return self._head_started + self.limits.header_timeout + paused

    def _body_deadline(self) -> float:
        limits = self.limits
        extra = self._body_bytes / limits.body_min_rate if limits.body_min_rate > 0 else 0.0
        paused = self.flow.paused_seconds() - self._body_paused
        return self._body_started + limits.body_timeout + extra + paused

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._refusal is not None:
            return
        now = self.loop.time()
        if self._phase == _BODY:
            deadline = self._body_deadline()
            if now < deadline:  # bytes came, or the server paused reading, meanwhile
                self._timer = self.loop.call_at(deadline, self._timed_out)
                return
            self._refusal = (408, "request body not received in time", "body_timeout")
        elif self._phase == _HEAD:
            deadline = self._head_deadline()
            if now < deadline:  # the server paused reading meanwhile
                self._timer = self.loop.call_at(deadline, self._timed_out)
                return
            self._refusal = (408, "request header not received in time", "header_timeout")
        else:
            return
        self._refuse()

    # --------------------------------------------------------------------- refusals
    def _refuse(self) -> None:
        """Answer the pending refusal and close, without disturbing an answer under way.

        A head refused while an earlier (pipelined) request is still being answered closes the
        connection after that answer; a body refused after the app began answering (it
        answered without reading the body) closes at once.
        """
        assert self._refusal is not None
        status, message, reason = self._refusal
        self.table.record(reason, self.loop.time())
        cycle = self.cycle
        if self._phase == _BODY and cycle is not None:
            if cycle.response_started or cycle.response_complete:
                self.transport.close()
                return
            cycle.disconnected = True  # the app's receive() returns http.disconnect
            cycle.message_event.set()
            self._answer(status, message, reason)
            return
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False  # an earlier request is being answered: close after it
            return
        if status == 408 and self._head_raw == 0 and self._phase != _BODY:
            self.transport.close()  # not one byte of a request: close like a keep-alive timeout
            return
        self._answer(status, message, reason)

    def _answer(self, status: int, message: str, code: str) -> None:
        """Write a whole error response (OpenAI's body) and close the connection.

        Its ``x-request-id`` is the request's (``gateway.transport.request_id``) once its head
        is complete, else a new one: a head cut short is not believed.
        """
        if self._refusal is None:
            self._refusal = (status, message, code)
        body = json.dumps(error_body(status, message, code=code)).encode()
        rid = request_id(self.scope) if self._phase == _BODY else new_id()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
            b"x-request-id: %s\r\n" % rid.encode("ascii"),
        ]
        if status == 503:
            head.append(b"retry-after: 1\r\n")
        head += [b"\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()


def limited_protocol(limits: TransportLimits) -> type[LimitedHttpProtocol]:
    """A :class:`LimitedHttpProtocol` class for one server: ``limits`` and a fresh table.

    Pass it as ``uvicorn.Config(http=...)``; its ``table`` counts that server's connections.
    """
    table = ConnectionTable(limits.max_connections, limits.key_share)
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits, "table": table})
