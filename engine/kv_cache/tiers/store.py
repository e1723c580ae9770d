"""The tiers below the paged pool as one store: write-through offers, prefix lookups and loads."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from loraplex.engine.kv_cache.tiers.base import KVTier
from loraplex.engine.kv_cache.tiers.codec import check_payload
from loraplex.engine.kv_cache.tiers.host import HostTier

log = logging.getLogger(__name__)

_WRITE_BATCH = 64  # blocks the writer takes at a time (one contains_many per tier)
_LOAD_BATCH = 64  # blocks a remote tier is asked for in one round trip


BACKGROUND_NICE = 10
"""The nice value of the tiers' threads (Linux: per thread), so the engine's step wins the CPU."""


def background_priority() -> None:
    """Lower the calling thread's CPU priority to ``BACKGROUND_NICE`` (best effort).

    On Linux ``setpriority(PRIO_PROCESS, 0, n)`` sets the calling thread's nice value: the
    tiers' copies and writes then take the CPU the step leaves (CFS weights nice 10 about
    1:10 against 0). It does not help against the interpreter lock (docs/kv_tiers.md).
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
        pass


class TieredStore:
    """Host, disk and remote tiers (any subset, fastest first) behind one asynchronous interface.

    Offers are write-through: a background writer puts each offered block into every tier that
    lacks it; when more than ``max_pending_bytes`` wait, an offer is dropped (``dropped``) rather
    than blocking the engine's step. Loads run on a background loader thread and read the longest
    leading run of present blocks, each from the first tier that has it, promoting disk and
    remote hits into the host tier. The scheme is vLLM's KV connector / CPU offloading and
    LMCache's storage backends: blocks keyed by the prefix hashes of the pool.

    Args:
        tiers: The tiers, fastest first (names unique); hits of the others are promoted into the
            first ``HostTier``. A tier whose class sets ``local = False``
            is asked in one round trip per call (``contains_many`` / ``get_many``).
        max_pending_bytes: Bound on the payload bytes offered and not yet written (>= 0).

    Raises:
        ValueError: two tiers share a name, or ``max_pending_bytes`` is negative.
    """

    def __init__(self, tiers: list[KVTier], *, max_pending_bytes: int) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes must be >= 0, got {max_pending_bytes}")
        self.tiers = list(tiers)
        self.max_pending_bytes = int(max_pending_bytes)
        self._host = next((t for t in self.tiers if isinstance(t, HostTier)), None)
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, torch.Tensor]] = deque()
        self._queued: set[bytes] = set()
        self._pending_bytes = 0
        self._writing = 0
        self._closed = False
        self._counters = {
            "offered": 0,
            "dropped": 0,
            "written": 0,
            "write_errors": 0,
            "lookups": 0,
            "lookup_hit_blocks": 0,
            "loads": 0,
            "loaded_blocks": 0,
            "load_errors": 0,
            "promotions": 0,
        }
        self._loaded = {t.name: {"blocks": 0, "bytes": 0, "seconds": 0.0} for t in self.tiers}
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._loader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kv-tier-load", initializer=background_priority
        )

    # -- writes -----------------------------------------------------------------------------

    def offer(self, key: bytes, payload: torch.Tensor) -> bool:
        """Queue ``payload`` to be written to every tier that lacks ``key``; never blocks.

        Args:
            key: The block hash.
            payload: The block, a contiguous 1-D uint8 CPU tensor; the store keeps it (no copy),
                so the caller hands over a tensor it no longer writes to (a copy out of the pool).

        Returns:
            True when queued (or already queued); False when dropped: the store is closed or
            the pending bytes would exceed ``max_pending_bytes``.

        Raises:
            ValueError: ``payload`` is not a block payload.
        """
        check_payload(payload)
        size = payload.numel()
        with self._cond:
            self._counters["offered"] += 1
            if key in self._queued:
                return True
            if self._closed or self._pending_bytes + size > self.max_pending_bytes:
                self._counters["dropped"] += 1
                return False
            self._queue.append((key, payload))
            self._queued.add(key)
            self._pending_bytes += size
            self._cond.notify_all()
            return True

    def _write_loop(self) -> None:
        background_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = [self._queue.popleft() for _ in range(min(_WRITE_BATCH, len(self._queue)))]
                self._writing = len(batch)
            try:
                self._write(batch)
            finally:
                with self._cond:
                    for key, payload in batch:
                        self._queued.discard(key)
                        self._pending_bytes -= payload.numel()
                    self._writing = 0
                    self._cond.notify_all()

    def _write(self, batch: list[tuple[bytes, torch.Tensor]]) -> None:
        keys = [k for k, _ in batch]
        written = errors = 0
        for tier in self.tiers:
            try:
                present = tier.contains_many(keys)
                for (key, payload), held in zip(batch, present, strict=True):
                    if not held:
                        written += tier.put(key, payload)
            except Exception:  # a tier's bug must not kill the writer
                log.exception("KV tier %s failed a write", tier.name)
                errors += 1
        with self._cond:
            self._counters["written"] += written
            self._counters["write_errors"] += errors

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued offer is written.

        Returns:
            True when nothing is pending; False when ``timeout`` (s) passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._writing:
                if self._closed:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    @property
    def pending_bytes(self) -> int:
        """Payload bytes offered and not yet written."""
        with self._cond:
            return self._pending_bytes

    # -- reads ------------------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` some tier holds (stops at the first held by none).

        Local tiers answer from their indexes; a remote tier in one round trip for the keys the
        tiers before it lack. A block may still be evicted before ``load_prefix`` reads it.
        """
        n = len(keys)
        present = [False] * n
        for tier in self.tiers:
            todo = [i for i in range(n) if not present[i]]
            if not todo:
                break
            try:
                held = tier.contains_many([keys[i] for i in todo])
            except Exception:
                log.exception("KV tier %s failed a lookup", tier.name)
                continue
            for i, h in zip(todo, held, strict=True):
                present[i] = present[i] or h
        count = next((i for i, p in enumerate(present) if not p), n)
        with self._cond:
            self._counters["lookups"] += 1
            self._counters["lookup_hit_blocks"] += count
        return count

    def load_prefix(self, keys: Sequence[bytes]) -> concurrent.futures.Future[list[torch.Tensor]]:
        """Read the longest leading run of ``keys`` on the loader thread.

        Each block comes from the first tier that serves it (a corrupt record in one tier falls
        through to the next); disk and remote hits are promoted into the host tier.

        Returns:
            A future of the payloads of that prefix, in order (possibly empty): it stops at the
            first key no tier serves.
        """
        keys = list(keys)
        with self._cond:
            if not self._closed:
                return self._loader.submit(self._load, keys)
        done: concurrent.futures.Future[list[torch.Tensor]] = concurrent.futures.Future()
        done.set_result([])
        return done

    def read_prefix(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """Read the longest leading run of ``keys`` on the calling thread (see ``load_prefix``).

        For a caller that budgets its own time: the engine's connector reads a chunk of blocks
        between two steps (engine.core.kv_tiers).
        """
        return self._load(list(keys))

    def _load(self, keys: list[bytes]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        local = [t for t in self.tiers if t.local]
        remote = [t for t in self.tiers if not t.local]
        i = 0
        while i < len(keys):
            payload = self._get_local(local, keys[i])
            if payload is not None:
                out.append(payload)
                i += 1
                continue
            # A run of keys no local tier holds, asked of the remote tiers in one round trip.
            j = i + 1
            while (
                j < len(keys)
                and j - i < _LOAD_BATCH
                and not any(t.contains(keys[j]) for t in local)
            ):
                j += 1
            got = self._get_remote(remote, keys[i:j])
            for payload in got:
                out.append(payload)
            if len(got) < j - i:
                break
            i = j
        with self._cond:
            self._counters["loads"] += 1
            self._counters["loaded_blocks"] += len(out)
        return out

    def _record(self, tier: KVTier, payload: torch.Tensor, seconds: float) -> None:
        with self._cond:
            row = self._loaded[tier.name]
            row["blocks"] += 1
            row["bytes"] += payload.numel()
            row["seconds"] += seconds

    def _promote(self, tier: KVTier, key: bytes, payload: torch.Tensor) -> None:
        if self._host is None or tier is self._host:
            return
        if self._host.put(key, payload):
            with self._cond:
                self._counters["promotions"] += 1

    def _get_local(self, tiers: list[KVTier], key: bytes) -> torch.Tensor | None:
        for tier in tiers:
            if not tier.contains(key):
                continue
            start = time.perf_counter()
            try:
                payload = tier.get(key)
            except Exception:
                log.exception("KV tier %s failed a read", tier.name)
                self._counters_add("load_errors")
                continue
            if payload is not None:
                self._record(tier, payload, time.perf_counter() - start)
                self._promote(tier, key, payload)
                return payload
        return None

    def _get_remote(self, tiers: list[KVTier], keys: list[bytes]) -> list[torch.Tensor]:
        """The leading payloads of ``keys`` the remote tiers serve (each tier for what is left)."""
        got: list[torch.Tensor | None] = [None] * len(keys)
        for tier in tiers:
            todo = [i for i, p in enumerate(got) if p is None]
            if not todo:
                break
            start = time.perf_counter()
            try:
                payloads = tier.get_many([keys[i] for i in todo])
            except Exception:
                log.exception("KV tier %s failed a read", tier.name)
                self._counters_add("load_errors")
                continue
            served = [(i, p) for i, p in zip(todo, payloads, strict=True) if p is not None]
            per_block = (time.perf_counter() - start) / max(1, len(served))
            for i, payload in served:
                got[i] = payload
                self._record(tier, payload, per_block)
                self._promote(tier, keys[i], payload)
        prefix = []
        for payload in got:
            if payload is None:
                break
            prefix.append(payload)
        return prefix

    def _counters_add(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counters[name] += n

    # -- state ------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Per tier: its counters, bytes held and what loads took from it; then the store's.

        Returns:
            ``{"tiers": {name: {hits, misses, ..., used_bytes, capacity_bytes, blocks,
            loaded_blocks, loaded_bytes, load_seconds}}, "store": {offered, dropped, written,
            write_errors, lookups, lookup_hit_blocks, loads, loaded_blocks, load_errors,
            promotions, pending_bytes, max_pending_bytes}}``; ``written`` counts puts summed
            over the tiers, ``dropped`` the offers refused or discarded at ``close``.
        """
        tiers = {}
        for tier in self.tiers:
            row = tier.snapshot()
            with self._cond:
                loaded = dict(self._loaded[tier.name])
            row.update(
                loaded_blocks=loaded["blocks"],
                loaded_bytes=loaded["bytes"],
                load_seconds=loaded["seconds"],
            )
            tiers[tier.name] = row
        with self._cond:
            store = dict(
                self._counters,
                pending_bytes=self._pending_bytes,
                max_pending_bytes=self.max_pending_bytes,
            )
        return {"tiers": tiers, "store": store}

    def close(self) -> None:
        """Stop the writer, wait for loads in flight, close every tier; idempotent.

        Offers still queued are dropped (counted): ``flush`` first to keep them.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._counters["dropped"] += len(self._queue)
            for key, payload in self._queue:
                self._queued.discard(key)
                self._pending_bytes -= payload.numel()
            self._queue.clear()
            self._cond.notify_all()
        self._writer.join()
        self._loader.shutdown(wait=True)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                log.exception("KV tier %s failed to close", tier.name)
