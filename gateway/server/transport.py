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
  (:class:`~gateway.server.http_protocol.PauseClock`).
* **Write deadline.** When the client stops taking the response (the transport's buffer
  passes its 64 KiB high-water mark, so uvicorn's sends wait), the write must resume within
  ``write_timeout`` seconds plus one second per ``write_min_rate`` bytes the client takes
  meanwhile (nginx's ``send_timeout``, with ``mod_reqtimeout``'s ``MinRate`` scheme for a
  slow but honest reader); past it the connection is reset (``SO_LINGER`` 0, nginx's
  ``reset_timedout_connection``), the app sees the client gone, and a chat request is aborted
  in the engine and billed ``aborted`` (``write_timeout``). uvicorn bounds no write: a client
  that never reads held its response, its task and its key's slot forever (issue 27).
* **Open connections.** At most ``max_connections``; when a new one would pass it, the
  connection that has waited longest without a request running (idle keep-alive, or still
  sending its head) is closed to make room; if there is none, the writer whose client has
  stopped reading for longest (paused for ``stalled_after`` seconds or more) is reset; when
  every connection is serving a client that reads, the new one gets ``503`` and is closed. A
  slowloris or a reader that never reads is evicted by newcomers; clients being served are
  never touched.
* **One key's share.** A connection counts for the API key of its last authenticated request
  (``Exchange.serve_key``, from the auth middleware); one key holds at most
  ``max_connections_per_key`` (a quarter of ``max_connections`` unless set) at once. Past it
  the key's longest-idle connection is closed to make room, else the request gets ``429``
  (``too_many_connections``, ``Retry-After: 1``) and its connection closes.

A request costs nothing extra when it arrives in one read: the timers are armed only for heads
and bodies still incomplete after a read, and for writes the client stopped taking. Refusals
are counted (:class:`ConnectionTable`) and summed up in one log line a minute at most.

:func:`limited_protocol` makes the protocol class for one server (``uvicorn.Config(http=...)``);
:func:`uvicorn_config` builds the whole uvicorn configuration for the gateway.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import uvicorn

from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.server.http_protocol import (
    Exchange,
    LimitedHttpProtocol,
    PauseClock,
    exchange_of,
)

__all__ = [
    "ConnectionTable",
    "Exchange",
    "LimitedHttpProtocol",
    "PauseClock",
    "TransportLimits",
    "exchange_of",
    "fit_connection_cap",
    "limited_protocol",
    "uvicorn_config",
]

logger = logging.getLogger("loraplex.transport")

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
        write_timeout: Seconds a paused response write may wait for the client to take bytes,
            plus ``taken / write_min_rate``; reset beyond (nginx's ``send_timeout``).
        write_min_rate: Bytes per second the client takes that extend the write deadline
            (0: a fixed deadline per pause).
        max_connections_per_key: Connections one API key may hold at once; None: a quarter of
            ``max_connections`` (:attr:`key_share`).
        stalled_after: Seconds writing must have been paused before the connection may be
            evicted for a newcomer as a stalled writer.
    """

    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 20.0
    body_min_rate: float = 16 * 1024
    max_connections: int = 1024
    write_timeout: float = 30.0
    write_min_rate: float = 1024
    max_connections_per_key: int | None = None
    stalled_after: float = 1.0

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
            write_timeout=config.write_timeout_seconds,
            write_min_rate=config.write_min_bytes_per_second,
            max_connections_per_key=config.max_connections_per_key,
        )

    @property
    def max_head_raw_bytes(self) -> int:
        """Raw bytes an incomplete head may reach before it is refused."""
        return 2 * self.max_header_bytes + 4 * self.max_headers

    @property
    def key_share(self) -> int:
        """Connections one key may hold.

        ``max_connections_per_key``, else a quarter of the table (at least 1); never more
        than the table.
        """
        share = self.max_connections_per_key or max(1, self.max_connections // 4)
        return min(share, self.max_connections)


class ConnectionTable:
    """One server's open connections, whether waiting, stalled or keyed, and its refusals.

    Tracked: the connections waiting without a running request, the stalled writers, the
    connections of each API key.

    Args:
        max_connections: Open connections at most.
        key_share: Connections one API key may hold at once (default: all of them).

    Attributes:
        open: Connections open now (evicted ones no longer count).
        totals: Refusals since start by reason: ``header_too_large`` (431), ``header_timeout``
            and ``body_timeout`` (408, or closed), ``evicted`` (an idle connection closed for
            a newcomer), ``evicted_stalled`` (a stalled writer reset for a newcomer),
            ``write_timeout`` (reset at the write deadline), ``connection_limit`` (503),
            ``key_connection_limit`` (429: the key held its share).
    """

    def __init__(self, max_connections: int, key_share: int | None = None) -> None:
        self.max_connections = max_connections
        self.key_share = key_share or max_connections
        self.open = 0
        self.totals: dict[str, int] = {}
        self._waiting: OrderedDict[LimitedHttpProtocol, None] = OrderedDict()
        self._stalled: OrderedDict[LimitedHttpProtocol, float] = OrderedDict()  # -> paused at
        self._by_key: dict[str, dict[LimitedHttpProtocol, None]] = {}
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

    def stall(self, conn: LimitedHttpProtocol, now: float) -> None:
        """``conn``'s writes are paused since ``now`` (loop time): its client stopped reading."""
        self._stalled[conn] = now
        self._stalled.move_to_end(conn)

    def unstall(self, conn: LimitedHttpProtocol) -> None:
        """``conn`` takes writes again (or is gone)."""
        self._stalled.pop(conn, None)

    def oldest_stalled(self, before: float) -> LimitedHttpProtocol | None:
        """The writer paused longest, taken off the table; None if none is, or since ``before``.

        ``before`` is loop time (s): a writer paused later is not stalled yet. The eviction of
        idle connections for a newcomer, extended to connections whose client has stopped
        reading: they hold the table as surely as an idle one, and cost more.
        """
        for conn, since in self._stalled.items():
            if since > before:
                return None
            del self._stalled[conn]
            return conn
        return None

    def stalled(self) -> int:
        """Connections whose writes are paused now."""
        return len(self._stalled)

    def claim(self, conn: LimitedHttpProtocol, key_id: str, now: float) -> bool:
        """Count ``conn`` as serving ``key_id`` (no longer as serving any other key).

        At the key's share, the key's connection idle longest is closed to make room
        (counted as ``evicted``); when none of them is idle, the claim is refused (counted as
        ``key_connection_limit``) and ``conn`` keeps its old key, if any. nginx's
        ``limit_conn`` caps connections per key the same way (its key a variable such as the
        client address; here the API key, known once the request is authenticated).

        Returns:
            True when ``conn`` now counts for ``key_id``.
        """
        if conn.key_id == key_id:
            return True
        held = self._by_key.get(key_id)
        if held is not None and len(held) >= self.key_share:
            idle = next((c for c in held if c in self._waiting), None)
            if idle is None:
                self.record("key_connection_limit", now)
                return False
            self.record("evicted", now)
            idle._drop()
        self.unkey(conn)
        self._by_key.setdefault(key_id, {})[conn] = None
        conn.key_id = key_id
        return True

    def unkey(self, conn: LimitedHttpProtocol) -> None:
        """``conn`` no longer counts for its key (it is gone)."""
        key_id = conn.key_id
        if key_id is None:
            return
        conn.key_id = None
        held = self._by_key.get(key_id)
        if held is not None:
            held.pop(conn, None)
            if not held:
                del self._by_key[key_id]

    def held_by(self, key_id: str) -> int:
        """Open connections counted for ``key_id``."""
        return len(self._by_key.get(key_id, ()))

    def record(self, reason: str, now: float) -> None:
        """Count one refusal; log the last minute's refusals at most once a minute."""
        self.totals[reason] = self.totals.get(reason, 0) + 1
        self._recent[reason] = self._recent.get(reason, 0) + 1
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_SECONDS:
            summary = ", ".join(f"{k} {v}" for k, v in sorted(self._recent.items()))
            logger.warning("transport limits: refused %s (%d open)", summary, self.open)
            self._recent.clear()
            self._logged_at = now


def limited_protocol(limits: TransportLimits) -> type[LimitedHttpProtocol]:
    """A :class:`LimitedHttpProtocol` class for one server: ``limits`` and a fresh table.

    Pass it as ``uvicorn.Config(http=...)``; its ``table`` counts that server's connections.
    """
    table = ConnectionTable(limits.max_connections, limits.key_share)
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits, "table": table})


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
