"""KV cache blocks and the free-block queue (the eviction order of the block pool).

The queue is a doubly linked list threaded through the blocks themselves (vLLM v1's
``FreeKVCacheBlockQueue`` design), so a block that a prefix hit revives is unlinked from the
middle in O(1)::

    head <-> [b7] <-> [b3] <-> [b12] <-> ... <-> tail
             evicted first                 freed last

Blocks are popped from the front when the pool needs a fresh block and appended at the back
when their ref count drops to 0, so the front holds the least recently used blocks.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One physical KV block: ``block_size`` token slots in every layer's K and V cache.

    Attributes:
        block_id: Index into the pool, ``[0, num_blocks)``; slot ``block_id * block_size + i``
            of the KV tensors holds its token ``i``.
        ref_cnt: Number of requests (sequences) whose block tables hold this block. 0 means the
            block is in the free queue (possibly still cached).
        block_hash: The block's hash while it is in the prefix cache, else None.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked queue of free blocks: pop from the front, append at the back, remove anywhere.

    All operations are O(1) per block. Two sentinel nodes bound the list so no operation
    branches on emptiness of a neighbour.

    Args:
        blocks: The initial free blocks, front first.

    Attributes:
        head: Sentinel before the front block (block id -1).
        tail: Sentinel after the back block (block id -1).
        num_free: Blocks in the queue.
    """

    __slots__ = ("head", "tail", "num_free")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        self.append_n(list(blocks))

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` front blocks, front first.

        The caller must set ``prev_free = None`` on each returned block (the pool does it in
        its eviction pass, saving a loop on the allocation hot path).

        Raises:
            ValueError: fewer than ``n`` blocks are free (nothing is removed then).
        """
        if n > self.num_free:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free} free")
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        node = self.head.next_free
        append = out.append
        for _ in range(n):
            append(node)
            node = node.next_free
        # Popped blocks keep stale ``next_free`` links and the caller clears ``prev_free``
        # (BlockPool.get_new_blocks does it in its own pass): membership is ``prev_free``.
        self.head.next_free = node
        node.prev_free = self.head
        self.num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue.

        Raises:
            ValueError: the block is not in the queue.
        """
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append blocks at the back (evicted last), in the given order."""
        if not blocks:
            return
        last = self.tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self.tail
        self.tail.prev_free = last
        self.num_free += len(blocks)

    def appendleft_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert blocks at the front (evicted first), in the given order."""
        if not blocks:
            return
        first = self.head.next_free
        prev = self.head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = first
        first.prev_free = prev
        self.num_free += len(blocks)

    def __iter__(self):
        """Iterate front to back (eviction order)."""
        node = self.head.next_free
        while node is not self.tail:
            yield node
            node = node.next_free

    def __len__(self) -> int:
        return self.num_free
