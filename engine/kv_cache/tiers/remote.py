"""The shared tier: KV blocks in Redis, read and written by every engine replica and machine.

Chosen over an fsspec object store and Ray's object store by ``bench.kv_shared_tier``
(docs/kv_tiers.md): the lowest latency per block here, one pipelined round trip for a whole
prefix lookup or load, records that outlive the replica that wrote them, and an existing,
widely run server. Needs the ``redis`` package (``pip install loraplex[redis]``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Sequence

import torch

from loraplex.engine.kv_cache.tiers import codec
from loraplex.engine.kv_cache.tiers.base import KVTier
from loraplex.engine.kv_cache.tiers.layout import KVLayout

log = logging.getLogger(__name__)

# Evict the least recently used records of the namespace beyond max_records (run in the same
# MULTI/EXEC as the SET NX and the ZADD of a store, so the bound holds whichever replica writes).
# KEYS: the index (sorted set: record key -> last access time). ARGV: max_records.
_EVICT_SCRIPT = """
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1])
if over <= 0 then return 0 end
local old = redis.call('ZPOPMIN', KEYS[1], over)
for i = 1, #old, 2 do redis.call('UNLINK', old[i]) end
return over
"""

_FAILED = object()


def _redacted(url: str) -> str:
    """``url`` without its user and password, for logs."""
    parts = urllib.parse.urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


class RedisTier(KVTier):
    """Blocks as codec records in Redis under ``<namespace>:<fingerprint>:b:<key hex>``.

    Bounded by our own accounting, atomic on the server: a sorted set
    ``<namespace>:<fingerprint>:lru`` scores each record by its last access (the clients'
    clocks), and every store (SET NX, ZADD and a Lua eviction in one MULTI/EXEC) evicts the
    oldest records beyond
    ``capacity_bytes // record size``, so the bound holds for the namespace whichever replica
    writes (give every replica the same capacity). A server-wide ``maxmemory`` with
    ``allkeys-lru`` is a useful second fence: a record Redis evicts on its own reads as a miss.
    Every record is verified on read (``codec.decode``); a corrupt one is deleted. A server that
    is down or slow (connection refused, timeout after ``timeout_s``) never raises into the
    caller: the call counts in ``stats.errors`` and reads as a miss / not stored, and for
    ``retry_after_s`` the tier answers that way without trying, so an outage costs one timeout,
    not one per block. Not for Redis Cluster (a script touches the index and the record).

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        layout: The layout of the blocks; its fingerprint namespaces the keys.
        capacity_bytes: Bound on the bytes of the namespace's records (all replicas together).
        name: The tier's name in stats.
        namespace: Prefix of every key.
        timeout_s: Connect and socket timeout of each call (s).
        retry_after_s: How long a failure short-circuits later calls (s).
        batch_bytes: Bytes of records asked for in one pipelined round trip by ``get_many``.

    Raises:
        ValueError: a malformed URL.
    """

    local = False

    def __init__(
        self,
        url: str,
        layout: KVLayout,
        capacity_bytes: int,
        *,
        name: str = "remote",
        namespace: str = "loraplex:kv",
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        batch_bytes: int = 2 << 20,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        super().__init__(name, capacity_bytes)
        self.layout = layout
        self.url = url
        self._where = _redacted(url)
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.batch_bytes = batch_bytes
        self._prefix = f"{namespace}:{layout.fingerprint()}:".encode()
        self._index_key = self._prefix + b"lru"
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._down_until = 0.0
        self._failing = False
        self._state_lock = threading.Lock()
        self._key_nbytes = 32
        self._last_count = 0
        about = json.dumps(layout.to_dict(), sort_keys=True)  # for humans (redis-cli)
        self._call(lambda: self._client.set(self._prefix + b"layout", about, nx=True))

    def record_key(self, key: bytes) -> bytes:
        """The Redis key of ``key``'s record."""
        return self._prefix + b"b:" + key.hex().encode()

    # -- failures ---------------------------------------------------------------------------

    def _call(self, fn):
        """``fn()``, or ``_FAILED`` (counted) when the server failed now or recently."""
        now = time.monotonic()
        with self._state_lock:
            down = now < self._down_until
        if down:
            self._count(errors=1)
            return _FAILED
        try:
            result = fn()
        except Exception as exc:  # redis.RedisError, OSError, a protocol error: all a miss
            with self._state_lock:
                first = not self._failing
                self._failing = True
                self._down_until = time.monotonic() + self.retry_after_s
            if first:
                log.warning(
                    "KV remote tier %s unavailable (%s); retrying every %.1f s",
                    self._where,
                    exc,
                    self.retry_after_s,
                )
            self._count(errors=1)
            return _FAILED
        if self._failing:
            with self._state_lock:
                self._failing = False
            log.warning("KV remote tier %s answers again", self._where)
        return result

    # -- the tier ---------------------------------------------------------------------------

    def _record_nbytes(self) -> int:
        return codec.frame_nbytes(self._key_nbytes, self.layout)

    def _usage(self) -> tuple[int, int]:
        count = self._call(lambda: self._client.zcard(self._index_key))
        if count is not _FAILED:
            self._last_count = int(count)
        return self._last_count * self._record_nbytes(), self._last_count

    @property
    def used_bytes(self) -> int:
        """Bytes of the namespace's records, from the server (the last known on a failure)."""
        return self._usage()[0]

    def __len__(self) -> int:
        """Records of the namespace, from the server (the last known on a failure)."""
        return self._usage()[1]

    def contains(self, key: bytes) -> bool:
        """Whether the server holds ``key``'s record (False when it cannot be asked)."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` of each key in one pipelined round trip."""
        if not keys:
            return []

        def ask():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.record_key(key))
            return pipe.execute()

        found = self._call(ask)
        if found is _FAILED:
            return [False] * len(keys)
        return [bool(n) for n in found]

    def get(self, key: bytes) -> torch.Tensor | None:
        """``key``'s payload, verified; None on a miss, a corrupt record or a failure."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """The payload of each key (or None), pipelined; hits become recent.

        One round trip per ``batch_bytes`` of records: past a few MiB in flight a pipeline
        gets slower per block on loopback (``bench.kv_shared_tier``). A corrupt record
        (``codec.CorruptBlock``) is deleted and counted, and reads as None.
        """
        if not keys:
            return []
        start = time.perf_counter()
        records = [self.record_key(k) for k in keys]

        per_trip = max(1, self.batch_bytes // codec.frame_nbytes(len(keys[0]), self.layout))

        def fetch():
            frames = []
            for i in range(0, len(records), per_trip):
                pipe = self._client.pipeline(transaction=False)
                chunk = records[i : i + per_trip]
                for rec in chunk:
                    pipe.get(rec)
                pipe.zadd(self._index_key, dict.fromkeys(chunk, time.time()), xx=True)
                frames.extend(pipe.execute()[:-1])
            return frames

        frames = self._call(fetch)
        if frames is _FAILED:
            self._count(misses=len(keys))
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        bad: list[bytes] = []
        for key, rec, frame in zip(keys, records, frames, strict=True):
            if frame is None:
                out.append(None)
                continue
            try:
                out.append(codec.decode(frame, key, self.layout))
            except codec.CorruptBlock as exc:
                log.warning("dropping corrupt KV record %r: %s", rec, exc)
                bad.append(rec)
                out.append(None)
        if bad:
            self._call(
                lambda: (
                    self._client.pipeline(transaction=False)
                    .delete(*bad)
                    .zrem(self._index_key, *bad)
                    .execute()
                )
            )
        hits = [p for p in out if p is not None]
        self._count(
            hits=len(hits),
            misses=len(out) - len(hits),
            corrupt=len(bad),
            bytes_read=sum(p.numel() for p in hits),
            read_seconds=time.perf_counter() - start,
        )
        return out

    def put(self, key: bytes, payload: torch.Tensor) -> bool:
        """Store ``key``'s record unless the server has it, evicting the oldest beyond the bound.

        Returns:
            False when a record alone exceeds ``capacity_bytes`` or the server failed.

        Raises:
            ValueError: a malformed key or payload (wrong length for the layout).
        """
        frame = codec.encode(key, payload, self.layout)
        max_records = self.capacity_bytes // len(frame)
        if max_records < 1:
            self._count(rejected=1)
            return False
        self._key_nbytes = len(key)
        start = time.perf_counter()
        rec = self.record_key(key)

        def store():
            pipe = self._client.pipeline(transaction=True)
            pipe.set(rec, frame, nx=True)
            pipe.zadd(self._index_key, {rec: time.time()})
            pipe.eval(_EVICT_SCRIPT, 1, self._index_key, max_records)  # no extra round trip
            return pipe.execute()

        result = self._call(store)
        if result is _FAILED:
            return False
        stored, evicted = bool(result[0]), int(result[2])
        self._count(
            stores=int(stored),
            evictions=evicted,
            bytes_written=len(frame) if stored else 0,
            write_seconds=time.perf_counter() - start,
        )
        return True

    def clear(self) -> None:
        """Delete every record of this namespace (tests, operators); a failure is counted."""

        def wipe():
            names = list(self._client.scan_iter(match=self._prefix + b"*", count=1000))
            for i in range(0, len(names), 1000):
                self._client.delete(*names[i : i + 1000])

        self._call(wipe)

    def close(self) -> None:
        """Close the connections (the records stay on the server)."""
        try:
            self._client.close()
        except Exception:
            pass
