"""The block pool: every KV block, allocated up front, shared by all adapters and tenants.

The pool owns the free queue and the prefix cache (``block hash -> block``). A cached block with
ref count 0 sits in the free queue and can be revived by a prefix hit (:meth:`BlockPool.touch`)
until the pool hands it out as a fresh block, at which point it loses its hash (eviction).

Eviction order (the seeds' policy; vLLM's and RadixAttention's): only ref-count-0 blocks; least
recently used first; among blocks freed at the same time, the one with the most blocks before it
first (callers free a request's blocks tail-first). Blocks that hold no hash are put at the front
of the queue when freed: evicting them first costs no cache hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from loraplex.engine.kv_cache.block import FreeBlockQueue, KVCacheBlock


class BlockPool:
    """All KV blocks, the free queue and the prefix-cache map.

    Args:
        num_blocks: Blocks in the pool (> 0).
        enable_caching: Keep the hashes of full blocks so later requests can hit them.

    Attributes:
        events: Where hashes dropped from the cache are reported (``removed`` on eviction
            and uncaching, ``cleared`` on reset; ``engine.kv_cache.events.KVEventLog``), or None.

    Raises:
        ValueError: ``num_blocks`` is not positive.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self.epoch = 0  # bumped whenever a cached hash is dropped (eviction or reset)
        self.events = None

    @property
    def num_free(self) -> int:
        """Blocks with ref count 0 (some may still be cached)."""
        return self.free_queue.num_free

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks in use, in ``[0, 1]``."""
        return self.num_used / self.num_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit (reviving free ones).

        A revived block is unlinked from the free queue in O(1) (inlined
        ``FreeBlockQueue.remove``: this is the hot path of a prefix hit).
        """
        revived = 0
        for block in blocks:
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                revived += 1
            block.ref_cnt += 1
        self.free_queue.num_free -= revived

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` fresh blocks from the front of the free queue, evicting their hashes.

        Returns:
            The blocks, each with ref count 1 and no hash.

        Raises:
            ValueError: fewer than ``n`` blocks are free (nothing changes then).
        """
        queue = self.free_queue
        if n > queue.num_free:
            raise ValueError(f"asked for {n} free blocks, only {queue.num_free} free")
        # FreeBlockQueue.popleft_n and the eviction pass fused into one walk (hot path).
        cached = self.cached
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        evicted: list[bytes] = []
        node = queue.head.next_free
        for _ in range(n):
            block = node
            node = block.next_free
            block.prev_free = block.next_free = None
            if block.block_hash is not None:
                # Invariant: a block holds a hash only while it is the cached block for it.
                del cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            append(block)
        queue.head.next_free = node
        node.prev_free = queue.head
        queue.num_free -= n
        if evicted:
            self.num_evictions += len(evicted)
            self.epoch += 1
            if self.events is not None:
                self.events.removed(evicted)
        return blocks

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Drop the hash of each block that is the cached copy of one; its KV is not trusted.

        For blocks registered before their KV was written (allocation caches the blocks a step
        will fill) when that step failed: no later request may hit them.

        Returns:
            How many hashes were dropped.
        """
        dropped: list[bytes] = []
        for block in blocks:
            h = block.block_hash
            if h is not None and self.cached.get(h) is block:
                del self.cached[h]
                block.block_hash = None
                dropped.append(h)
        if dropped:
            self.epoch += 1
            if self.events is not None:
                self.events.removed(dropped)
        return len(dropped)

    def free_blocks(self, ordered: Sequence[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 return to the free queue.

        Args:
            ordered: Blocks in eviction priority order (callers pass a request's blocks
                tail-first). Cached blocks go to the back of the queue in this order; uncached
                ones go to the front.

        Raises:
            ValueError: a block's ref count is already 0 (a double free; nothing changes then).
        """
        if any(block.ref_cnt <= 0 for block in ordered):
            bad = next(block for block in ordered if block.ref_cnt <= 0)
            raise ValueError(f"double free of block {bad.block_id}")
        queue = self.free_queue
        last = queue.tail.prev_free  # cached blocks are linked at the back as they come
        uncached: list[KVCacheBlock] = []
        released = 0
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                    continue
                last.next_free = block
                block.prev_free = last
                last = block
                released += 1
        last.next_free = queue.tail
        queue.tail.prev_free = last
        queue.num_free += released
        if uncached:
            queue.appendleft_n(uncached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash.

        Returns:
            False, changing nothing, while any block is in use (a running request may be
            about to look up or register hashes); True once the cache is empty.
        """
        if self.num_used:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.epoch += 1
        if self.events is not None:
            self.events.cleared()
        return True
