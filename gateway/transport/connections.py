"""One server's open connections: waiting, stalled and keyed ones, evictions and refusals."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

logger = logging.getLogger("loraplex.transport")

LOG_EVERY_SECONDS = 60.0


class Connection(Protocol):
    """What the table needs of a connection (``http_protocol.LimitedHttpProtocol`` is one)."""

    key_id: str | None  # the API key the connection counts for; set by the table only

    def _drop(self) -> None:
        """Close the connection now (evicted for a newcomer)."""


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
        self._waiting: OrderedDict[Connection, None] = OrderedDict()
        self._stalled: OrderedDict[Connection, float] = OrderedDict()  # -> paused at
        self._by_key: dict[str, dict[Connection, None]] = {}
        self._recent: dict[str, int] = {}
        self._logged_at: float | None = None

    def wait(self, conn: Connection) -> None:
        """``conn`` has no request running (newest waiter)."""
        self._waiting[conn] = None
        self._waiting.move_to_end(conn)

    def busy(self, conn: Connection) -> None:
        """``conn`` runs a request (or is gone): not to be evicted."""
        self._waiting.pop(conn, None)

    def oldest_waiting(self) -> Connection | None:
        """The connection that has waited longest, taken off the table; None if none waits."""
        if not self._waiting:
            return None
        conn, _ = self._waiting.popitem(last=False)
        return conn

    def stall(self, conn: Connection, now: float) -> None:
        """``conn``'s writes are paused since ``now`` (loop time): its client stopped reading."""
        self._stalled[conn] = now
        self._stalled.move_to_end(conn)

    def unstall(self, conn: Connection) -> None:
        """``conn`` takes writes again (or is gone)."""
        self._stalled.pop(conn, None)

    def oldest_stalled(self, before: float) -> Connection | None:
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

    def claim(self, conn: Connection, key_id: str, now: float) -> bool:
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

    def unkey(self, conn: Connection) -> None:
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
