"""The HTTP protocol ``serve`` runs: uvicorn's httptools one with the gateway's transport limits.

:class:`LimitedHttpProtocol` hooks uvicorn's own parser callbacks and protocol methods, each
calling uvicorn's implementation; :class:`PauseClock` is uvicorn's flow control, timing the
pauses that must not count against a client's deadlines. The limits, the connection table and
uvicorn's configuration live in :mod:`gateway.server.transport`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from loraplex.gateway.server.errors import error_body

if TYPE_CHECKING:
    from loraplex.gateway.server.transport import ConnectionTable, TransportLimits

_IDLE, _HEAD, _BODY = 0, 1, 2  # between requests; reading a head; reading a body


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


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits :mod:`gateway.server.transport` describes.

    Use the subclass :func:`gateway.server.transport.limited_protocol` makes: it binds
    ``limits`` and one server's ``table``.
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

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection (making room, or refusing it, at the cap); start its head clock."""
        super().connection_made(transport)
        self.flow = PauseClock(transport, self.loop.time)  # uvicorn's, timing its pauses
        table = self.table
        now = self.loop.time()
        if table.open >= table.max_connections:
            victim = table.oldest_waiting()
            if victim is None:
                table.record("connection_limit", now)
                self._answer(503, "too many open connections; retry later", "connection_limit")
                return
            table.record("evicted", now)
            victim._drop()
        table.open += 1
        self._counted = True
        table.wait(self)
        self._head_started = now
        self._head_paused = 0.0
        self._timer = self.loop.call_at(now + self.limits.header_timeout, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and its timer."""
        self._drop_accounting()
        super().connection_lost(exc)

    def _drop_accounting(self) -> None:
        self._cancel_timer()
        self.table.busy(self)
        if self._counted:
            self._counted = False
            self.table.open -= 1

    def _drop(self) -> None:
        """Close (evicted for a newcomer): no request runs on it."""
        self._drop_accounting()
        self._refusal = (0, "", "evicted")
        if not self.transport.is_closing():
            self.transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

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
                self.send_400_response(msg)
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
        """The head is in: checked, its clock stops, the body's starts, the app runs (uvicorn's)."""
        self._check_head()
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
        """As uvicorn's; a connection with no request left running may be evicted again."""
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
        """Write a whole error response (OpenAI's body) and close the connection."""
        if self._refusal is None:
            self._refusal = (status, message, code)
        body = json.dumps(error_body(status, message, code=code)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
        ]
        if status == 503:
            head.append(b"retry-after: 1\r\n")
        head += [b"\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()
