"""Per-key rate limits: requests per minute, tokens per minute, concurrent requests.

Token buckets (the scheme OpenAI's and most gateways' limits follow): each key has a request
bucket of capacity ``requests_per_minute`` refilled at ``rpm / 60`` per second, and a token
bucket of capacity ``tokens_per_minute`` refilled at ``tpm / 60`` per second. Admission takes one
request from the first and needs the second to be positive; when the request ends, the tokens it
actually used (prompt + completion) are taken from the token bucket, which may go negative, so a
large request delays the next ones instead of being refused up front. A refusal carries the time
until admission would succeed, for ``Retry-After``. State lives in this process; it is lost on
restart, which only forgives. Gateways that share keys share limits through
:mod:`gateway.limits.ratelimit_shared` (the same scheme in Redis; ``--rate-limit-url``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.gateway.services.tenants import TenantLimits


class RateLimitExceeded(Exception):
    """A key is over one of its limits.

    Attributes:
        limit: ``"requests_per_minute"``, ``"tokens_per_minute"`` or ``"max_concurrent_requests"``.
        retry_after: Seconds until a retry can succeed (an estimate for concurrency).
    """

    def __init__(self, limit: str, retry_after: float) -> None:
        super().__init__(f"rate limit exceeded: {limit}")
        self.limit = limit
        self.retry_after = retry_after


@dataclass
class _Bucket:
    level: float
    stamp: float
    capacity: float | None = None  # the limit the level was computed under; None: unlimited

    def refill(self, capacity: float, per_second: float, now: float) -> None:
        if self.capacity != capacity:  # a new or changed limit: an unlimited key counts as full
            self.level = capacity if self.capacity is None else min(self.level, capacity)
            self.capacity = capacity
        self.level = min(capacity, self.level + (now - self.stamp) * per_second)
        self.stamp = now


@dataclass
class _KeyState:
    requests: _Bucket
    tokens: _Bucket
    in_flight: int = 0


class Ticket:
    """An admitted request; :meth:`release` it exactly once, with the tokens it used.

    The concurrency slot (and the charge of the tokens) is given back to the limiter once the
    request has been released **and** every :meth:`hold` let go: the chat controller holds
    the ticket until the response has been written to the client or the connection cut
    (``gateway.transport.http_protocol.Exchange.on_written``), so a client that stops reading
    keeps its slot taken instead of the engine's end freeing it (issue 27). Both limiters,
    in process and in Redis (:mod:`gateway.limits.ratelimit_shared`), hand out this ticket.

    Args:
        release: The limiter's own release of this request, given the tokens it used.
    """

    def __init__(self, release: Callable[[int], None]) -> None:
        self._release = release
        self._released = False
        self._holds = 0
        self._tokens: int | None = None  # set by release(); the limiter is told when unheld

    def release(self, tokens_used: int) -> None:
        """End the request: free its concurrency slot, charge its tokens. Idempotent.

        While a :meth:`hold` is on, the limiter hears of it when the last hold is let go.
        """
        if self._tokens is not None:
            return
        self._tokens = max(0, tokens_used)
        if self._holds == 0:
            self._give_back()

    def hold(self) -> Callable[[], None]:
        """Keep the slot taken past :meth:`release` until the returned function is called.

        A reference count on the release: the slot goes back when the request has ended and
        every holder has let go, in whichever order.

        Returns:
            Lets this hold go (idempotent); the last one let go after :meth:`release` gives
            the slot back.
        """
        self._holds += 1
        held = True

        def let_go() -> None:
            nonlocal held
            if not held:
                return
            held = False
            self._holds -= 1
            if self._holds == 0 and self._tokens is not None:
                self._give_back()

        return let_go

    @property
    def released(self) -> bool:
        """True once the limiter has the slot back."""
        return self._released

    def _give_back(self) -> None:
        if self._released:
            return
        self._released = True
        self._release(self._tokens or 0)


class Limiter:
    """A per-key rate limiter, as the gateway uses one (a Litestar dependency's type).

    :class:`RateLimiter` keeps its buckets in this process;
    ``gateway.limits.ratelimit_shared.SharedRateLimiter`` shares them through Redis.
    """

    async def acquire(self, key_id: str, limits: TenantLimits) -> Ticket:
        """Admit one request of ``key_id`` under ``limits``.

        Raises:
            RateLimitExceeded: a limit of the key is reached.
        """
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the limiter holds (connections, tasks)."""


class RateLimiter(Limiter):
    """Token-bucket limits per API key.

    Args:
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}

    def admit(self, key_id: str, limits: TenantLimits) -> Ticket:
        """Admit one request for ``key_id`` under ``limits`` (None fields: unlimited).

        Raises:
            RateLimitExceeded: over a limit; nothing was taken.
        """
        now = self._clock()
        state = self._state(key_id, limits, now)
        rpm, tpm, conc = (
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_concurrent_requests,
        )
        if rpm is not None:
            state.requests.refill(rpm, rpm / 60.0, now)
        else:
            state.requests.capacity = None
        if tpm is not None:
            state.tokens.refill(tpm, tpm / 60.0, now)
        else:
            state.tokens.capacity = None
        if conc is not None and state.in_flight >= conc:
            raise RateLimitExceeded("max_concurrent_requests", 1.0)
        if rpm is not None and state.requests.level < 1.0:
            raise RateLimitExceeded(
                "requests_per_minute", (1.0 - state.requests.level) / (rpm / 60.0)
            )
        if tpm is not None and state.tokens.level <= 0.0:
            raise RateLimitExceeded("tokens_per_minute", (1.0 - state.tokens.level) / (tpm / 60.0))
        if rpm is not None:
            state.requests.level -= 1.0
        state.in_flight += 1
        return Ticket(functools.partial(self._release, key_id, limits))

    async def acquire(self, key_id: str, limits: TenantLimits) -> Ticket:
        """:meth:`admit`, as the shared limiter is called (its state is remote).

        Raises:
            RateLimitExceeded: over a limit; nothing was taken.
        """
        return self.admit(key_id, limits)

    async def close(self) -> None:
        """Nothing to release (the shared limiter closes its connections)."""

    def in_flight(self, key_id: str) -> int:
        """Requests of ``key_id`` admitted and not yet released."""
        state = self._keys.get(key_id)
        return state.in_flight if state else 0

    def _state(self, key_id: str, limits: TenantLimits, now: float) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            state = _KeyState(requests=_Bucket(0.0, now), tokens=_Bucket(0.0, now))
            self._keys[key_id] = state
        return state

    def _release(self, key_id: str, limits: TenantLimits, tokens_used: int) -> None:
        state = self._keys.get(key_id)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        tpm = limits.tokens_per_minute
        if tpm is not None:
            now = self._clock()
            state.tokens.refill(tpm, tpm / 60.0, now)
            state.tokens.level -= max(0, tokens_used)
