"""Admission control: a global bound on the work the server has accepted and not finished.

Per-key rate limits (``gateway.limits.ratelimit``) bound each key; nothing bounded the sum, so
thousands of concurrent streams queued without end (TTFT p99 of 75 s, never a 503). Here every
admitted chat request holds one slot of ``max_requests`` from admission to its usage row, and
once its prompt is processed it also holds ``prompt + max_tokens`` of ``max_tokens`` tokens.
Past either bound a new request gets 503 + ``Retry-After`` (OpenAI's ``overloaded`` case)
instead of joining a queue it would wait in for minutes.

No tenant may hold more than ``tenant_share`` of either bound, so one tenant's flood cannot
fill the server and turn every other tenant away: with the default of a half, a tenant alone
still gets half the capacity, and another tenant always finds the other half.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class OverloadedError(RuntimeError):
    """The server (or this tenant's share of it) is full: answer 503 + ``Retry-After``.

    Attributes:
        retry_after: Seconds the client should wait.
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _Usage:
    requests: int = 0
    tokens: int = 0


@dataclass
class AdmissionTicket:
    """One admitted request's hold on the bounds; :meth:`release` once, when it ends."""

    control: AdmissionControl
    tenant: str
    tokens: int = 0
    released: bool = field(default=False)

    def reserve_tokens(self, tokens: int) -> None:
        """Hold ``tokens`` more (prompt + max_tokens, once known).

        Raises:
            OverloadedError: the tokens would exceed the global bound or the tenant's share.
        """
        self.control._reserve(self, tokens)

    def release(self) -> None:
        """Give back the request slot and the tokens (later calls do nothing)."""
        if not self.released:
            self.released = True
            self.control._release(self)


class AdmissionControl:
    """Global bounds on outstanding requests and tokens, with a per-tenant share.

    Args:
        max_requests: Requests admitted and not finished, at most (None: no bound).
        max_tokens: Their prompt + max_tokens, at most (None: no bound).
        tenant_share: Fraction of each bound one tenant may hold, in ``(0, 1]``.

    Raises:
        ValueError: a bound below 1 or a share outside ``(0, 1]``.
    """

    def __init__(
        self, max_requests: int | None, max_tokens: int | None, tenant_share: float = 0.5
    ) -> None:
        if (max_requests is not None and max_requests < 1) or (
            max_tokens is not None and max_tokens < 1
        ):
            raise ValueError("admission bounds must be at least 1")
        if not 0.0 < tenant_share <= 1.0:
            raise ValueError("tenant_share must be in (0, 1]")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.tenant_share = tenant_share
        self.total = _Usage()
        self._tenants: dict[str, _Usage] = {}

    def _share(self, bound: int) -> int:
        return max(1, int(bound * self.tenant_share))

    def admit(self, tenant: str) -> AdmissionTicket:
        """Take a request slot for ``tenant``.

        Raises:
            OverloadedError: the server has ``max_requests`` outstanding, or the tenant its
                share of them.
        """
        mine = self._tenants.get(tenant) or _Usage()
        if self.max_requests is not None:
            if self.total.requests >= self.max_requests:
                raise OverloadedError(
                    f"the server is at its limit of {self.max_requests} requests in progress"
                )
            if mine.requests >= self._share(self.max_requests):
                raise OverloadedError(
                    f"your requests in progress are at this server's limit per tenant "
                    f"({self._share(self.max_requests)})"
                )
        mine.requests += 1
        self._tenants[tenant] = mine
        self.total.requests += 1
        return AdmissionTicket(self, tenant)

    def _reserve(self, ticket: AdmissionTicket, tokens: int) -> None:
        if ticket.released:
            return
        mine = self._tenants[ticket.tenant]
        if self.max_tokens is not None:
            if self.total.tokens + tokens > self.max_tokens:
                raise OverloadedError(
                    f"the server is at its limit of {self.max_tokens} tokens in progress"
                )
            if mine.tokens + tokens > self._share(self.max_tokens):
                raise OverloadedError(
                    f"your tokens in progress would pass this server's limit per tenant "
                    f"({self._share(self.max_tokens)})"
                )
        mine.tokens += tokens
        self.total.tokens += tokens
        ticket.tokens += tokens

    def _release(self, ticket: AdmissionTicket) -> None:
        mine = self._tenants[ticket.tenant]
        mine.requests -= 1
        mine.tokens -= ticket.tokens
        self.total.requests -= 1
        self.total.tokens -= ticket.tokens
        if mine.requests == 0:
            del self._tenants[ticket.tenant]

    def outstanding(self, tenant: str | None = None) -> tuple[int, int]:
        """``(requests, tokens)`` outstanding, for one tenant or in all."""
        usage = self.total if tenant is None else self._tenants.get(tenant, _Usage())
        return usage.requests, usage.tokens
