"""The HTTP transport's limits: head size and count, read and write deadlines, connections.

What each limit does is the package's docstring (:mod:`gateway.transport`) and docs/transport.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.gateway.server.config import GatewayConfig


@dataclass(frozen=True)
class TransportLimits:
    """The limits of ``http_protocol.LimitedHttpProtocol`` (see the package docstring).

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
