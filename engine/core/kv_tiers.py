"""The engine's side of the KV tiers: offload computed blocks, load tier hits back.

The tiers themselves (host memory, local disk, a store shared by replicas) are
``engine.kv_cache.tiers``; this module moves blocks between them and the paged pool, in the way
of vLLM's KV connector (``WAITING_FOR_REMOTE_KVS``) and LMCache's store/retrieve:

- **Offload (write-through).** After each step, the blocks the step filled (full, computed,
  registered in the prefix cache under their hash) are pinned and handed to a background
  thread that copies them out of the pool (``engine.runner.kv_transfer.gather_blocks``) and
  offers them to the store, whose own writer puts them in every tier. So a block the pool
  evicts later is already below it, and a restart or another replica finds it.
- **Load.** A new request whose prompt continues past its pool prefix hit with blocks some
  tier holds waits for them off the scheduler, as a request waits for its grammar. Between
  steps, on the engine thread, the connector pins fresh pool blocks for them, reads them from
  the tiers (``TieredStore.read_prefix``: verified, host first) and copies them in
  (``scatter_blocks``), a chunk at a time within a time budget (a share of the step time
  while other requests run, unbounded when the engine is idle); once all are in it registers
  them under their hashes and queues the request, whose prefix lookup now hits them
  (``cached_tokens`` counts them). A load that cannot get blocks, or whose pool prefix was
  evicted meanwhile, queues the request as is: it recomputes.

Every transfer holds its blocks pinned (``KVCacheManager.pin_cached`` / ``pin_new``) so no step
reads, writes or evicts them meanwhile. docs/kv_tiers.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.engine.kv_cache.block import KVCacheBlock
from loraplex.engine.kv_cache.manager import KVCacheManager
from loraplex.engine.kv_cache.tiers.store import background_priority
from loraplex.engine.runner.kv_transfer import KVCaches, gather_blocks, scatter_blocks
from loraplex.engine.scheduling.output import SchedulerOutput
from loraplex.engine.sequence import Sequence

logger = logging.getLogger(__name__)

LOAD_CHUNK = 16
"""Most blocks a load reads and copies in one go (a remote tier: one round trip per chunk)."""

LOAD_MIN_CHUNK = 8
"""While requests run, a load waits until its time credit pays for this many blocks at once."""

LOAD_CREDIT_CAP_S = 0.05
"""Most loading time saved up across polls (s)."""


@dataclass(slots=True)
class _Load:
    """One request's tier load: fresh pool blocks filled chunk by chunk between steps."""

    seq: Sequence
    first_block: int  # logical index of the first block the tiers hold (the pool hit's end)
    hashes: list[bytes]  # the tier-held run of block hashes from ``first_block``
    started: float
    prefix: list[KVCacheBlock] = field(default_factory=list)  # pinned pool hit
    fresh: list[KVCacheBlock] = field(default_factory=list)  # pinned blocks being written
    done: int = 0  # blocks of ``fresh`` written so far
    aborted: bool = False


@dataclass(slots=True)
class KVTierStats:
    """What the connector moved, since start.

    Attributes:
        offloaded_blocks: Blocks copied out of the pool and offered to the store.
        offload_seconds: Background seconds spent copying them out.
        loads: Requests that waited for a tier load.
        loaded_blocks: Blocks copied into the pool from a tier.
        load_seconds: Wall seconds requests waited for their loads (sum).
        loads_fallen_back: Loads given up (no free blocks, the pool prefix evicted meanwhile,
            a read that found nothing): the request recomputes.
    """

    offloaded_blocks: int = 0
    offload_seconds: float = 0.0
    loads: int = 0
    loaded_blocks: int = 0
    load_seconds: float = 0.0
    loads_fallen_back: int = 0


class KVTierConnector:
    """Moves KV blocks between the paged pool and a ``TieredStore``.

    Args:
        store: The tiers (``engine.kv_cache.tiers.TieredStore``).
        kv: The engine's KV cache manager (its pool and prefix cache).
        kv_caches: The pool's tensors (``ModelRunner.kv_caches``).
        max_load_fraction: At most this fraction of the pool may be pinned by loads at once;
            a load past it falls back to recompute.

    Only the engine thread calls the methods; the copies and tier reads run on two
    background threads (one for offloads, one for loads).
    """

    def __init__(
        self,
        store: Any,
        kv: KVCacheManager,
        kv_caches: KVCaches,
        *,
        max_load_fraction: float = 0.5,
    ) -> None:
        self.store = store
        self.kv = kv
        self.kv_caches = kv_caches
        self.block_size = kv.block_size
        self.max_load_blocks = max(1, int(kv.pool.num_blocks * max_load_fraction))
        self.stats = KVTierStats()
        # A background thread at a lower CPU priority: the step goes first (store.py).
        self._offload_pool = ThreadPoolExecutor(
            1, thread_name_prefix="kv-offload", initializer=background_priority
        )
        self._offloads: list[tuple[Future, list[KVCacheBlock]]] = []
        self._loads: dict[str, _Load] = {}
        self._block_seconds = 1e-3  # moving average of a block's read + copy in
        self._credit_s = 0.0  # loading time saved up across polls (a token bucket)
        k0 = kv_caches[0][0]
        block_nbytes = k0[0].numel() * k0.element_size() * 2 * len(kv_caches)
        # Reused by every chunk's copy in: no allocation (and no page faults) per chunk.
        self._staging = torch.empty((LOAD_CHUNK, block_nbytes), dtype=torch.uint8)

    # ------------------------------------------------------------------------- offload
    def offload_step(self, sched: SchedulerOutput, seqs: Mapping[str, Sequence]) -> int:
        """Offer the blocks a step filled to the tiers (copied out off the step).

        Args:
            sched: The step that just ran (after ``update_from_output``).
            seqs: The step's sequences by id, taken before the update (finished ones
                included: their blocks are cached until evicted).

        Returns:
            How many blocks were pinned for offloading.
        """
        bs = self.block_size
        hashes: list[bytes] = []
        seen: set[bytes] = set()
        for item in sched.scheduled:
            seq = seqs.get(item.seq_id)
            if seq is None:
                continue
            block_hashes = seq.hasher.block_hashes
            hi = min(len(block_hashes), seq.num_computed_tokens // bs)
            for h in block_hashes[item.start // bs : hi]:
                if h not in seen:
                    seen.add(h)
                    hashes.append(h)
        if not hashes:
            return 0
        blocks = self.kv.pin_cached(hashes)
        if blocks:
            ids = [b.block_id for b in blocks]
            keys = [b.block_hash for b in blocks]
            self._offloads.append((self._offload_pool.submit(self._offload, ids, keys), blocks))
        return len(blocks)

    def _offload(self, block_ids: list[int], keys: list[bytes]) -> int:
        """Background: copy pinned blocks out and offer them to the store."""
        t0 = time.perf_counter()
        payloads = gather_blocks(self.kv_caches, block_ids)
        for key, payload in zip(keys, payloads, strict=True):
            self.store.offer(key, payload)
        self.stats.offload_seconds += time.perf_counter() - t0
        return len(block_ids)

    # ---------------------------------------------------------------------------- load
    def start_load(self, seq: Sequence) -> bool:
        """Start loading the blocks past the sequence's pool prefix hit that a tier holds.

        Returns:
            True when the sequence must wait for its load (:meth:`poll` hands it back);
            False when there is nothing to load (queue it now).
        """
        if seq.prompt_logprobs is not None or not self.kv.enable_caching:
            return False
        hashes = seq.hasher.block_hashes
        max_blocks = min(len(hashes), (seq.num_tokens - 1) // self.block_size)
        first = len(self.kv.get_computed_blocks(hashes, seq.num_tokens).blocks)
        if first >= max_blocks:
            return False
        # Index lookups (host, disk) and one round trip to a shared store, on this thread:
        # a request the tiers cannot help is queued at once, without waiting for a poll.
        held = self.store.lookup_prefix(hashes[first:max_blocks])
        if held <= 0:
            return False
        wanted = list(hashes[first : first + held])
        self._loads[seq.seq_id] = _Load(seq, first, wanted, time.perf_counter())
        self.stats.loads += 1
        return True

    def poll(self, queue: Callable[[Sequence], None], budget_s: float | None = None) -> None:
        """Release finished offloads' pins; load tier blocks for about ``budget_s`` seconds.

        Loads run here, on the engine thread between steps, in chunks of blocks (read from
        the tiers, verified, copied into pinned fresh blocks), within the time credit the
        budgets add up to (:meth:`_copy_chunks`), the loads taking turns chunk by chunk
        (round robin); a finished load registers its blocks in the prefix cache and queues
        its request. On CPython a load on
        a background thread would hold the interpreter lock in every block's read and
        checksum, and each of the step's hundreds of small torch calls would wait for it
        (measured: the other requests' decode rate fell to 0.45x during a disk load;
        docs/kv_tiers.md), so the time it takes from the steps is bounded here instead.

        Args:
            queue: Hands a sequence to the scheduler (its load done or given up).
            budget_s: Seconds of loading this call adds to the credit; None: finish every
                load now (the engine has nothing else to run).
        """
        if self._offloads:
            still: list[tuple[Future, list[KVCacheBlock]]] = []
            for fut, blocks in self._offloads:
                if not fut.done():
                    still.append((fut, blocks))
                    continue
                self.kv.unpin(blocks[::-1])
                error = fut.exception()
                if error is not None:
                    logger.error("offloading %d KV blocks failed: %s", len(blocks), error)
                else:
                    self.stats.offloaded_blocks += len(blocks)
            self._offloads = still
        if not self._loads:
            return
        if budget_s is not None:
            self._credit_s = min(self._credit_s + budget_s, LOAD_CREDIT_CAP_S)
        for rid, load in list(self._loads.items()):
            if load.aborted:
                self._release(load)
                self._finish(rid, load, queue, fell_back=False)
                continue
            if not load.fresh and not self._begin(load):
                self._finish(rid, load, queue, fell_back=True)
                continue
            if not self._copy_chunks(load, budget_s):
                # Out of credit: go on at a later step, the next load first (round robin,
                # so one long load does not hold every other request's load behind it).
                self._loads[rid] = self._loads.pop(rid)
                return
            self._complete(rid, load, queue)

    def _begin(self, load: _Load) -> bool:
        """Pin the pool hit and fresh blocks for the load; False when it cannot (recompute)."""
        seq = load.seq
        hashes = seq.hasher.block_hashes
        # The pool prefix may have moved since the lookup: evicted (a gap: give up) or
        # grown (another request computed some of these blocks: skip them).
        now = len(self.kv.get_computed_blocks(hashes, seq.num_tokens).blocks)
        skip = now - load.first_block
        if skip < 0 or skip >= len(load.hashes):
            return False
        wanted = load.hashes[skip:]
        pinned = sum(len(x.fresh) for x in self._loads.values())
        if pinned + len(wanted) > self.max_load_blocks:
            return False
        # The pool hit first: taking fresh blocks evicts free cached ones, the hit's included.
        prefix = self.kv.pin_cached(hashes[:now])
        fresh = self.kv.pin_new(len(wanted))
        if fresh is None:
            self.kv.unpin(prefix[::-1])
            return False
        load.prefix = prefix
        load.first_block, load.hashes, load.fresh = now, wanted, fresh
        return True

    def _copy_chunks(self, load: _Load, budget_s: float | None) -> bool:
        """Read and copy until the load is done (True) or the time credit runs out (False).

        With a budget the connector saves time credit across polls (a token bucket filled by
        each poll's budget, capped at ``LOAD_CREDIT_CAP_S``) and spends it in chunks of at
        least ``LOAD_MIN_CHUNK`` blocks, sized from the measured time per block: one chunk
        every few steps amortises the per-chunk cost (one copy per layer, one round trip)
        that a block per step would pay each time, at the same share of the step time.
        """
        while load.done < len(load.fresh):
            left = len(load.fresh) - load.done
            if budget_s is None:
                n = min(left, LOAD_CHUNK)
            else:
                n = min(left, LOAD_CHUNK, int(self._credit_s / self._block_seconds))
                if n < min(left, LOAD_MIN_CHUNK):
                    if self._credit_s < LOAD_CREDIT_CAP_S:
                        return False  # save up for a whole chunk
                    # The credit is full and still pays for less than a whole chunk (blocks
                    # measured slow): read what it pays for, at least one block, or the load
                    # would wait until the engine is idle and hold its pins meanwhile.
                    n = max(1, n)
            t0 = time.perf_counter()
            end = load.done + n
            payloads = self.store.read_prefix(load.hashes[load.done : end])
            if payloads:
                ids = [b.block_id for b in load.fresh[load.done : load.done + len(payloads)]]
                scatter_blocks(self.kv_caches, ids, payloads, self._staging)
            spent = time.perf_counter() - t0
            if budget_s is not None:
                self._credit_s -= spent
            if payloads:
                per_block = spent / len(payloads)
                self._block_seconds = 0.7 * self._block_seconds + 0.3 * per_block
            load.done += len(payloads)
            if load.done < end:  # a block went missing (evicted, corrupt): stop before it
                break
        return True

    def _complete(self, rid: str, load: _Load, queue: Callable[[Sequence], None]) -> None:
        """Register the written blocks, release the pins, queue the request."""
        done = load.done
        if done:
            self.kv.register_loaded(load.fresh[:done], load.hashes[:done])
            self.stats.loaded_blocks += done
        self._release(load)
        self._finish(rid, load, queue, fell_back=done == 0)

    def _release(self, load: _Load) -> None:
        # Tail first: the prefix's last blocks are evicted before its first ones.
        self.kv.unpin(load.fresh[::-1] + load.prefix[::-1])
        load.fresh, load.prefix = [], []

    def _finish(
        self, rid: str, load: _Load, queue: Callable[[Sequence], None], *, fell_back: bool
    ) -> None:
        del self._loads[rid]
        self.stats.load_seconds += time.perf_counter() - load.started
        if fell_back:
            self.stats.loads_fallen_back += 1
        if not load.aborted:
            queue(load.seq)

    # ------------------------------------------------------------------------ requests
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._loads

    def abort(self, request_id: str) -> bool:
        """Forget a request waiting for its load (its pins are released at the next poll).

        Returns:
            False when the request is not waiting for a load.
        """
        load = self._loads.get(request_id)
        if load is None or load.aborted:
            return False
        load.aborted = True
        return True

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a tier load."""
        return sum(1 for x in self._loads.values() if not x.aborted)

    @property
    def busy(self) -> bool:
        """Any transfer in flight (a load or an offload)."""
        return bool(self._loads or self._offloads)

    def wait(self, timeout: float) -> None:
        """Block until an offload finishes or ``timeout`` seconds pass (an idle step)."""
        futures = [f for f, _ in self._offloads]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def snapshot(self) -> dict[str, Any]:
        """The connector's and the store's figures, for ``EngineCore.stats``.

        Flat numbers (a replica set adds its replicas' up): ``kv_tier_*`` for the connector,
        ``kv_tier_<tier>_<counter>`` per tier (host, disk, remote) and
        ``kv_tier_store_<counter>`` for the store (``flatten_tier_stats``).
        """
        s = self.stats
        return {
            "kv_tier_offloaded_blocks": s.offloaded_blocks,
            "kv_tier_offload_seconds": s.offload_seconds,
            "kv_tier_loads": s.loads,
            "kv_tier_loaded_blocks": s.loaded_blocks,
            "kv_tier_load_seconds": s.load_seconds,
            "kv_tier_loads_fallen_back": s.loads_fallen_back,
            "requests_waiting_for_kv": self.num_waiting,
            **flatten_tier_stats(self.store.stats()),
        }

    def close(self, timeout: float = 5.0) -> None:
        """Finish the copies in flight, release their pins, stop the threads, flush the store."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            self.wait(0.05)
            self.poll(lambda seq: None)
        self._offload_pool.shutdown(wait=True)
        flush = getattr(self.store, "flush", None)
        if flush is not None:
            flush(max(0.0, deadline - time.monotonic()))
        self.store.close()


def flatten_tier_stats(stats: Mapping[str, Any]) -> dict[str, float]:
    """``TieredStore.stats()`` flat: ``kv_tier_<tier>_<key>``, ``kv_tier_store_<key>``."""
    flat: dict[str, float] = {}
    for tier, row in stats.get("tiers", {}).items():
        for key, value in row.items():
            if isinstance(value, int | float):
                flat[f"kv_tier_{tier}_{key}"] = value
    for key, value in stats.get("store", {}).items():
        if isinstance(value, int | float):
            flat[f"kv_tier_store_{key}"] = value
    return flat


def build_kv_tier_connector(
    config: Any, model: torch.nn.Module, kv: KVCacheManager, kv_caches: KVCaches
) -> KVTierConnector | None:
    """The connector for the KV tiers ``config`` names, or None when it names none.

    The tiers, top down: host memory (``kv_offloading_bytes``), local disk (``kv_disk_dir``,
    ``kv_disk_bytes``), a shared store (``kv_remote_url``); keyed under a fingerprint of the
    model's identity, dtype, block size, shapes and hashing scheme.

    Raises:
        ValueError: a remote URL the shared tier cannot take.
        OSError: a disk tier directory that cannot be created.
    """
    if not config.kv_tiers_enabled:
        return None
    from loraplex.engine.kv_cache.tiers import DiskTier, HostTier, KVLayout, RedisTier, TieredStore
    from loraplex.engine.models.identity import model_identity

    layout = KVLayout(
        model=model_identity(config.model),
        dtype=str(kv_caches[0][0].dtype).removeprefix("torch."),
        block_size=config.block_size,
        num_layers=len(kv_caches),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        hash_scheme=f"{config.prefix_hash}/{config.mm_hash}",
    )
    tiers = []
    if config.kv_offloading_bytes:
        tiers.append(HostTier(config.kv_offloading_bytes))
    if config.kv_disk_bytes:
        tiers.append(DiskTier(config.kv_disk_dir, config.kv_disk_bytes, layout))
    if config.kv_remote_url:
        tiers.append(RedisTier(config.kv_remote_url, layout, config.kv_remote_bytes))
    # Writes waiting for the tiers: a bound so a slow disk or store drops writes, never
    # the step's memory (a write is one block's bytes).
    store = TieredStore(tiers, max_pending_bytes=max(64 << 20, 256 * layout.block_nbytes))
    logger.info(
        "KV tiers: %s (fingerprint %s, %d bytes per block)",
        ", ".join(t.name for t in tiers),
        layout.fingerprint()[:12],
        layout.block_nbytes,
    )
    return KVTierConnector(store, kv, kv_caches)
