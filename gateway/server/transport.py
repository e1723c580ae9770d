"""HTTP/1.1 transport limits: header size and count, header and body read deadlines, connections.

uvicorn (with httptools, the parser ``serve`` runs) bounds none of these: a client may send
headers without end, one byte at a time (slowloris), or dribble a body forever, and every
such connection costs a file descriptor and memory until it gives up. :class:`LimitedHttpProtocol`
is uvicorn's :class:`~uvicorn.protocols.http.httptools_impl.HttpToolsProtocol` with the limits
that servers such as Apache (``mod_reqtimeout``: ``header=20-40,MinRate=500 body=20,MinRate=500``,
``LimitRequestFieldSize``/``LimitRequestFields``), nginx (``client_header_timeout``,
``large_client_header_buffers``) and Node.js (``headersTimeout``, ``maxHeaderSize``) apply:

* **Head size and count.** The URL plus every header name and value of one request may hold
  ``max_header_bytes`` bytes, and a request at most ``max_headers`` header fields; past either,
  ``431 Request Header Fields Too Large`` and the connection closes. A head still incomplete
  after ``2 * max_header_bytes + 4 * max_headers`` raw bytes (delimiters and whitespace
  included) is refused the same way, so a header that never ends is never buffered further.
* **Head deadline.** A request's head must arrive within ``header_timeout`` seconds of its first
  byte (of the connection's opening for the first request): else ``408 Request Timeout`` and the
  connection closes (closed without an answer when not one byte came). Idle keep-alive time
  between requests is uvicorn's own ``timeout_keep_alive``.
* **Body deadline.** A body must arrive within ``body_timeout + received / body_min_rate``
  seconds of its head (Apache's ``MinRate``: each byte received earns ``1 / body_min_rate`` s
  more); else ``408`` when no answer was started (the app sees the client gone) and the
  connection closes. Time while the server itself stops reading (the app has not consumed the
  body yet; a pipelined request waits its turn) counts against neither deadline
  (:class:`PauseClock`).
* **Open connections.** At most ``max_connections``; when a new one would pass it, the
  connection that has waited longest without a request running (idle keep-alive, or still
  sending its head) is closed to make room, and when every connection is running a request the
  new one gets ``503`` and is closed. A slowloris holding the table is evicted by newcomers;
  clients whose requests are being served are never touched.

A request costs nothing extra when it arrives in one read: the timers are armed only for heads
and bodies still incomplete after a read. Refusals are counted (:class:`ConnectionTable`) and
summed up in one log line a minute at most.

:func:`limited_protocol` makes the protocol class for one server (``uvicorn.Config(http=...)``);
:func:`uvicorn_config` builds the whole uvicorn configuration for the gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.server.config import GatewayConfig
from gateway.server.errors import error_body

logger = logging.getLogger("loraplex.transport")

_IDLE, _HEAD, _BODY = 0, 1, 2  # between requests; reading a head; reading a body
FD_RESERVE = 256  # descriptors kept for the database pool, model and adapter files, logs
LOG_EVERY_SECONDS = 60.0


@dataclass(frozen=True)
class TransportLimits:
    """The limits of :class:`LimitedHttpProtocol` (see the module docstring).

    Attributes:
        max_header_bytes: Bytes of URL, header names and values per request; 431 beyond.
        max_headers: Header fields per request; 431 beyond.
        header_timeout: Seconds for a request's head, from its first byte (from the
            connection's opening for the first request); 408 and closed beyond.
        body_timeout: Seconds a body may take, plus ``received / body_min_rate``; 408 beyond.
        body_min_rate: Bytes per second that extend the body deadline (0: a fixed deadline).
        max_connections: Open connections at most (see the module docstring).
    """

    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 20.0
    body_min_rate: float = 16 * 1024
    max_connections: int = 1024

    @classmethod
    def of(cls, config: GatewayConfig) -> TransportLimits:
        """The limits ``config`` sets."""
        return cls(
            max_header_bytes=config.max_header_bytes,
            max_headers=config.max_headers,
            header_timeout=config.header_timeout_seconds,
            body_timeout=config.body_timeout_seconds,
            body_min_rate=config.body_min_bytes_per_second,
            max_connections=config.max_connections,
        )

    @property
    def max_head_raw_bytes(self) -> int:
        """Raw bytes an incomplete head may reach before it is refused."""
        return 2 * self.max_header_bytes + 4 * self.max_headers


class ConnectionTable:
    """One server's open connections, those waiting without a running request, and refusals.

    Args:
        max_connections: Open connections at most.

    Attributes:
        open: Connections open now (evicted ones no longer count).
        totals: Refusals since start by reason: ``header_too_large`` (431), ``header_timeout``
            and ``body_timeout`` (408, or closed), ``evicted`` (closed for a newcomer),
            ``connection_limit`` (503).
    """

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.open = 0
        self.totals: dict[str, int] = {}
        self._waiting: OrderedDict[LimitedHttpProtocol, None] = OrderedDict()
        self._recent: dict[str, int] = {}
        self._logged_at: float | None = None

    def wait(self, conn: LimitedHttpProtocol) -> None:
        """``conn`` has no request running (newest waiter)."""
        self._waiting[conn] = None
        self._waiting.move_to_end(conn)

    def busy(self, conn: LimitedHttpProtocol) -> None:
        """``conn`` runs a request (or is gone): not to be evicted."""
        self._waiting.pop(conn, None)

    def oldest_waiting(self) -> LimitedHttpProtocol | None:
        """The connection that has waited longest, taken off the table; None if none waits."""
        if not self._waiting:
            return None
        conn, _ = self._waiting.popitem(last=False)
        return conn

    def record(self, reason: str, now: float) -> None:
        """Count one refusal; log the last minute's refusals at most once a minute."""
        self.totals[reason] = self.totals.get(reason, 0) + 1
        self._recent[reason] = self._recent.get(reason, 0) + 1
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_SECONDS:
            summary = ", ".join(f"{k} {v}" for k, v in sorted(self._recent.items()))
            logger.warning("transport limits: refused %s (%d open)", summary, self.open)
            self._recent.clear()
            self._logged_at = now


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
    """uvicorn's httptools protocol with :class:`TransportLimits` (see the module docstring).

    Use the subclass :func:`limited_protocol` makes: it binds ``limits`` and one server's
    ``table``. The hooks are uvicorn's own parser callbacks and protocol methods, each calling
    uvicorn's implementation.
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


def limited_protocol(limits: TransportLimits) -> type[LimitedHttpProtocol]:
    """A :class:`LimitedHttpProtocol` class for one server: ``limits`` and a fresh table.

    Pass it as ``uvicorn.Config(http=...)``; its ``table`` counts that server's connections.
    """
    return type(
        "LimitedHttpProtocol",
        (LimitedHttpProtocol,),
        {"limits": limits, "table": ConnectionTable(limits.max_connections)},
    )


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
