"""Failed-authentication throttle per client address (against key guessing and HMAC floods).

After ``max_failures`` failed attempts (401) from one client within ``window`` seconds of the
first, that client gets 429 with ``Retry-After`` until the window ends, before any HMAC or
database work is done for it (fail2ban's and most login throttles' fixed window). A success
does not clear the count (else one valid key would let its owner interleave guesses for
ever), and other clients are never affected. The client is its address as the server sees it
(``scope["client"]``: the TCP peer, or the ``X-Forwarded-For`` address only where ``serve
--forwarded-allow-ips`` names the proxy); an IPv6 address counts by its /64, the smallest
prefix a site is usually given, so one host cannot step through its addresses. The table holds
at most ``max_clients`` entries; past that the one that failed least recently is forgotten.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

logger = logging.getLogger(__name__)


def client_group(client: tuple[str, int] | list | None) -> str:
    """The throttle's key for an ASGI ``scope["client"]``.

    Returns:
        The IPv4 address; an IPv6 address's /64 network (an IPv4-mapped one: its IPv4
        address); the host string as given when it is not an IP address; ``""`` when the
        server does not know the client (a Unix socket).
    """
    if not client:
        return ""
    host = client[0]
    if ":" not in host:
        return host  # IPv4 (or a name): the common case needs no parsing
    try:
        address = ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))


class AuthThrottle:
    """Failed attempts per client in fixed windows, with a bounded table.

    Args:
        max_failures: Failures per window before the client is refused (0: no throttle).
        window: Seconds from a client's first failure in a window to the window's end.
        max_clients: Entries kept at most (least recently failed evicted first).
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        max_failures: int,
        window: float,
        max_clients: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window = window
        self.max_clients = max_clients
        self._clock = clock
        self._entries: OrderedDict[str, list[float]] = OrderedDict()  # client -> [start, count]

    def __len__(self) -> int:
        return len(self._entries)

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may try again, or None when it is not refused now."""
        entry = self._entries.get(client)
        if entry is None or self.max_failures <= 0 or entry[1] < self.max_failures:
            return None
        left = entry[0] + self.window - self._clock()
        if left <= 0:
            del self._entries[client]  # the window is over: a clean slate
            return None
        return left

    def failed(self, client: str) -> None:
        """Count one failed attempt of ``client``."""
        if self.max_failures <= 0:
            return
        now = self._clock()
        entry = self._entries.get(client)
        if entry is None or now >= entry[0] + self.window:
            entry = [now, 0.0]
            self._entries[client] = entry
        self._entries.move_to_end(client)
        entry[1] += 1
        if entry[1] == self.max_failures:
            logger.warning(
                "%d failed authentication attempts from %s within %.0f s: refused until the "
                "window ends",
                self.max_failures,
                client or "an unknown client",
                self.window,
            )
        while len(self._entries) > self.max_clients:
            self._entries.popitem(last=False)
