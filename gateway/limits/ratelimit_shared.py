"""Per-key rate limits shared by every gateway: the same token buckets, kept in Redis.

Several gateways behind one load balancer must enforce one limit per key, not one each. This
limiter keeps :mod:`gateway.limits.ratelimit`'s scheme (a request bucket and a token bucket per
key, tokens charged after the request, possibly going negative; concurrent requests) in Redis,
through ``redis-py``'s asyncio client. Each admission and release is one Lua script, so it is
atomic across gateways, and reads the time from Redis (``TIME``), so gateways' clocks need not
agree. Keys (``loraplex:rl:{KEY_ID}:b``, a hash; ``...:l``, a sorted set; one hash tag, so one
Redis Cluster slot):

- the buckets: level, stamp and capacity per bucket, as the in-process ``_Bucket``; the hash
  expires once both buckets would be full again (plus a minute), which is the state a new key
  starts in, so an idle key costs nothing;
- the requests in flight, as **leases**: a member per admitted request scored by its expiry.
  This gateway renews the leases of its live requests every ``lease_seconds / 3``, so a
  gateway that crashes frees its keys' concurrency slots within ``lease_seconds`` (default 60)
  instead of never. (The counting semaphore with timed-out holders of *Redis in Action*,
  section 6.3, with the expiry as the score and renewal instead of a fixed timeout.)

When Redis cannot be reached, a key is limited by this gateway's in-process limiter instead
(never unlimited; never a 5xx because of the limiter), and a warning is logged at most every
30 s. After a failed call, admissions do not try Redis for :data:`RETRY_AFTER_FAILURE_S`, so an
outage does not add a socket timeout to every request; the shared state resumes when Redis
answers again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from urllib.parse import urlsplit

from loraplex.gateway.limits.ratelimit import Limiter, RateLimiter, RateLimitExceeded, Ticket
from loraplex.gateway.services.tenants import TenantLimits

logger = logging.getLogger(__name__)

LEASE_SECONDS = 60.0
RETRY_AFTER_FAILURE_S = 2.0  # after a failed call, admissions skip Redis this long
_WARN_EVERY_S = 30.0
_PREFIX = "loraplex:rl:"
_RELEASE_BATCH = 512

# Both scripts: KEYS[1] the bucket hash, KEYS[2] the lease set. Numbers cross as strings (a Lua
# number returned to Redis is cut to an integer).
_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function refill(p, cap, rate)
  local level = tonumber(redis.call('HGET', KEYS[1], p .. 'l'))
  local stamp = tonumber(redis.call('HGET', KEYS[1], p .. 's'))
  local old = tonumber(redis.call('HGET', KEYS[1], p .. 'c'))
  if level == nil or old == nil then
    level = cap
  elseif old ~= cap then
    level = math.min(level, cap)
  end
  if stamp == nil then stamp = now end
  level = math.min(cap, level + (now - stamp) * rate)
  return level
end
local function store(p, level, cap)
  redis.call('HSET', KEYS[1], p .. 'l', tostring(level), p .. 's', tostring(now), p .. 'c',
             tostring(cap))
end
local function expire(ttl)
  redis.call('PEXPIRE', KEYS[1], math.ceil((ttl + 60) * 1000))
end
"""

_ADMIT = (
    _COMMON
    + """
-- ARGV: rpm, tpm, max concurrent ('' = unlimited), lease id, lease seconds
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rl, tl
local ttl = 0
if rpm then rl = refill('r', rpm, rpm / 60) else redis.call('HDEL', KEYS[1], 'rl', 'rs', 'rc') end
if tpm then tl = refill('t', tpm, tpm / 60) else redis.call('HDEL', KEYS[1], 'tl', 'ts', 'tc') end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local verdict = nil
if conc and redis.call('ZCARD', KEYS[2]) >= conc then
  verdict = {'max_concurrent_requests', '1.0'}
elseif rpm and rl < 1 then
  verdict = {'requests_per_minute', tostring((1 - rl) / (rpm / 60))}
elseif tpm and tl <= 0 then
  verdict = {'tokens_per_minute', tostring((1 - tl) / (tpm / 60))}
end
if verdict == nil then
  if rpm then rl = rl - 1 end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[4])
  redis.call('PEXPIRE', KEYS[2], math.ceil(tonumber(ARGV[5]) * 1000) + 1000)
end
if rpm then store('r', rl, rpm); ttl = math.max(ttl, (rpm - rl) / (rpm / 60)) end
if tpm then store('t', tl, tpm); ttl = math.max(ttl, (tpm - tl) / (tpm / 60)) end
expire(ttl)
if verdict == nil then return {'ok', '0'} end
return verdict
"""
)

_RELEASE = (
    _COMMON
    + """
-- ARGV: lease id, tokens used, tpm ('' = unlimited)
redis.call('ZREM', KEYS[2], ARGV[1])
local tpm = tonumber(ARGV[3])
if tpm then
  local tl = refill('t', tpm, tpm / 60) - tonumber(ARGV[2])
  store('t', tl, tpm)
  local ttl = (tpm - tl) / (tpm / 60)
  local rc = tonumber(redis.call('HGET', KEYS[1], 'rc'))
  if rc then ttl = math.max(ttl, 60) end
  expire(ttl)
end
return 1
"""
)


def _keys(key_id: str) -> list[str]:
    return [f"{_PREFIX}{{{key_id}}}:b", f"{_PREFIX}{{{key_id}}}:l"]


def _arg(value: int | None) -> str:
    return "" if value is None else str(value)


class SharedRateLimiter(Limiter):
    """Token-bucket limits per API key in Redis, shared by every gateway that uses it.

    Args:
        url: A Redis URL (``redis://host:6379/0``, ``rediss://...``, ``unix://...``); its
            password, if any, is never logged.
        lease_seconds: How long a crashed gateway's requests keep their concurrency slots.
        timeout_seconds: Socket timeout of each Redis call, and the longest wait for a free
            connection; past it, the in-process fallback.
        max_connections: Admissions talking to Redis at once (others wait their turn, in
            order); releases go in pipelined batches on one more connection, renewals on
            another.

    Raises:
        ValueError: an invalid URL, or redis-py is not installed (the ``redis`` extra).
    """

    def __init__(
        self,
        url: str,
        *,
        lease_seconds: float = LEASE_SECONDS,
        timeout_seconds: float = 0.5,
        max_connections: int = 32,
    ) -> None:
        try:
            import redis.asyncio as redis
        except ModuleNotFoundError:
            raise ValueError(
                "--rate-limit-url needs redis-py: pip install 'loraplex[redis]'"
            ) from None

        parts = urlsplit(url)
        self.where = f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else parts.path
        self.lease_seconds = lease_seconds
        # Admissions take turns on a FIFO semaphore (redis-py's blocking pool is not fair: under
        # load a waiter can starve past any timeout); the releaser and the renewer have a
        # connection each on top.
        self._turns = asyncio.Semaphore(max_connections)
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections + 2,
            timeout=timeout_seconds,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            decode_responses=True,
        )
        self.redis = redis.Redis.from_pool(pool)
        self._admit = self.redis.register_script(_ADMIT)
        self._release_script = self.redis.register_script(_RELEASE)
        self.fallback = RateLimiter()
        self.fallback_admissions = 0  # admitted by the in-process fallback (Redis failed)
        self._live: dict[str, str] = {}  # lease -> key id, of this gateway's live requests
        self._releases: list[tuple[list[str], list[str]]] = []
        self._releaser: asyncio.Task | None = None
        self._renewer: asyncio.Task | None = None
        self._warned = float("-inf")
        self._down_until = float("-inf")

    # ------------------------------------------------------------------- admission
    async def acquire(self, key_id: str, limits: TenantLimits) -> Ticket:
        """Admit one request for ``key_id`` under ``limits`` (None fields: unlimited).

        Returns:
            A ticket to ``release`` once, with the tokens the request used.

        Raises:
            RateLimitExceeded: over a limit; nothing was taken.
        """
        if time.monotonic() < self._down_until:  # Redis failed just now: do not wait on it
            return self._fallback(key_id, limits)
        lease = uuid.uuid4().hex
        args = [
            _arg(limits.requests_per_minute),
            _arg(limits.tokens_per_minute),
            _arg(limits.max_concurrent_requests),
            lease,
            repr(self.lease_seconds),
        ]
        async with self._turns:
            if time.monotonic() < self._down_until:  # it failed while this one waited
                return self._fallback(key_id, limits)
            try:
                verdict, retry = await self._admit(keys=_keys(key_id), args=args)
            except Exception as exc:  # noqa: BLE001 - any Redis failure: limit in this process
                self._warn(exc)
                return self._fallback(key_id, limits)
        if verdict != "ok":
            raise RateLimitExceeded(verdict, float(retry))
        self._live[lease] = key_id
        self._ensure_renewer()
        return Ticket(functools.partial(self._release, key_id, lease, limits))

    def _fallback(self, key_id: str, limits: TenantLimits) -> Ticket:
        ticket = self.fallback.admit(key_id, limits)
        self.fallback_admissions += 1
        return ticket

    def _release(self, key_id: str, lease: str, limits: TenantLimits, tokens_used: int) -> None:
        """Queue the release; one background task sends the queue in pipelined batches."""
        self._live.pop(lease, None)
        args = [lease, str(tokens_used), _arg(limits.tokens_per_minute)]
        self._releases.append((_keys(key_id), args))
        if self._releaser is None or self._releaser.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (shutting down): the lease expires by itself
                return
            self._releaser = loop.create_task(self._send_releases())

    async def _send_releases(self) -> None:
        while self._releases:
            batch, self._releases = self._releases[:_RELEASE_BATCH], self._releases[_RELEASE_BATCH:]
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for keys, args in batch:
                        await self._release_script(keys=keys, args=args, client=pipe)
                    await pipe.execute()
            except Exception as exc:  # noqa: BLE001 - the leases expire; the tokens are forgiven
                self._warn(exc)

    # --------------------------------------------------------------------- leases
    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while self._live:
            await asyncio.sleep(self.lease_seconds / 3)
            await self.renew()

    async def renew(self) -> None:
        """Extend the leases of this gateway's live requests by ``lease_seconds``."""
        live = list(self._live.items())
        if not live:
            return
        try:
            now_s, now_us = await self.redis.time()
            expiry = now_s + now_us / 1e6 + self.lease_seconds
            async with self.redis.pipeline(transaction=False) as pipe:
                for lease, key_id in live:
                    pipe.zadd(_keys(key_id)[1], {lease: expiry}, xx=True)
                    pipe.pexpire(_keys(key_id)[1], int(self.lease_seconds * 1000) + 1000)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - tried again at the next renewal
            self._warn(exc)

    async def in_flight(self, key_id: str) -> int:
        """Requests of ``key_id`` holding an unexpired lease, across every gateway."""
        now_s, now_us = await self.redis.time()
        return await self.redis.zcount(_keys(key_id)[1], now_s + now_us / 1e6, "+inf")

    async def drain(self, timeout: float = 2.0) -> None:
        """Wait (up to ``timeout`` seconds) for the releases sent in the background."""
        if self._releaser is not None and not self._releaser.done():
            await asyncio.wait({self._releaser}, timeout=timeout)

    async def close(self) -> None:
        """Send the pending releases, stop renewing, close the connections."""
        await self.drain()
        if self._renewer is not None:
            self._renewer.cancel()
        await self.redis.aclose()

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._down_until = now + RETRY_AFTER_FAILURE_S
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            logger.warning(
                "the shared rate limiter's Redis at %s failed (%s: %s); limiting per gateway "
                "until it answers",
                self.where,
                type(exc).__name__,
                exc,
            )
