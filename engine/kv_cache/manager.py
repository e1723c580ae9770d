"""The KV cache manager: prefix lookup, slot allocation, block caching, fork and free.

The scheduler's interface to the block pool (vLLM v1's ``KVCacheManager``). One request's
blocks are its block table in logical order. Per step the scheduler asks for room for the tokens
it will compute; the manager answers with the blocks to append (and copies to make, for a
forked request writing into a shared partial block), or None when the pool cannot fit them, in
which case nothing changed::

    |<- num_computed_tokens ->|<- prefix hit (new requests) ->|<- num_new_tokens ->|
    | blocks already held     | cached blocks, ref taken      | fresh blocks       |
                                                               ^ all-or-nothing
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import takewhile
from operator import is_not

from loraplex.engine.kv_cache.block import KVCacheBlock
from loraplex.engine.kv_cache.block_pool import BlockPool
from loraplex.engine.kv_cache.events import KVEventLog
from loraplex.engine.kv_cache.stats import PrefixCacheStats

_is_block = partial(is_not, None)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix found for a request (:meth:`KVCacheManager.get_computed_blocks`).

    Attributes:
        blocks: The cached blocks, in logical order (no references taken yet).
        num_cached_tokens: Tokens they hold: ``len(blocks) * block_size``.
        num_queried_tokens: The prompt tokens that were looked up.
        pool_epoch: The pool's eviction epoch at lookup time; a match used after an eviction
            is re-checked against the request's hashes.
    """

    blocks: tuple[KVCacheBlock, ...] = ()
    num_cached_tokens: int = 0
    num_queried_tokens: int = 0
    pool_epoch: int = 0

    @property
    def block_ids(self) -> list[int]:
        """Physical ids of the matched blocks."""
        return [b.block_id for b in self.blocks]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy-on-write copy the model runner must make before the step's KV writes.

    Attributes:
        logical_index: Index in the request's block table that now points at ``dst``.
        src: Physical block id to copy every layer's K and V from.
        dst: Physical block id to copy them to.
    """

    logical_index: int
    src: int
    dst: int


@dataclass(slots=True)
class SlotAllocation:
    """What one successful :meth:`KVCacheManager.allocate_slots` changed.

    Attributes:
        new_block_ids: Physical ids appended to the request's block table, in logical order
            (prefix-hit blocks first, then fresh ones).
        copies: Copy-on-write replacements inside the block table.
    """

    new_block_ids: list[int] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[KVCacheBlock]
    num_cached_blocks: int = 0  # blocks[:num_cached_blocks] were offered to the prefix cache


class KVCacheManager:
    """Block allocation and automatic prefix caching for every running request.

    Args:
        num_blocks: Blocks in the pool.
        block_size: Token slots per block.
        enable_caching: Automatic prefix caching on or off.
        events: Where the cache's changes are reported (hashes stored, removed, cleared:
            ``engine.kv_cache.events``, for a router), or None.

    Raises:
        ValueError: a non-positive ``num_blocks`` or ``block_size``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KVEventLog | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events = events
        self.pool = BlockPool(num_blocks, enable_caching)
        self.pool.events = events
        self.stats = PrefixCacheStats()
        self._requests: dict[str, _RequestBlocks] = {}
        self.num_pinned = 0  # references held outside any request (KV tier transfers)

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not)."""
        return self.pool.num_free

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: physical block ids in logical order ([] when unknown)."""
        state = self._requests.get(request_id)
        return [b.block_id for b in state.blocks] if state is not None else []

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds."""
        state = self._requests.get(request_id)
        return len(state.blocks) if state is not None else 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get_computed_blocks(self, block_hashes: Sequence[bytes], num_tokens: int) -> PrefixMatch:
        """The longest run of cached blocks that starts the request.

        The hit is capped at ``num_tokens - 1`` tokens: the last prompt token is always computed,
        so the step produces its logits. No reference is taken; pass the match to
        :meth:`allocate_slots`.

        Args:
            block_hashes: The request's block hashes (full blocks only), logical order.
            num_tokens: The request's current token count (the prompt, for a new request).

        Returns:
            The match (empty when caching is off).
        """
        if not self.enable_caching or num_tokens <= 0:
            return PrefixMatch(num_queried_tokens=max(num_tokens, 0))
        max_blocks = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        # Stop at the first miss; a C-level loop (this is the per-request hot path).
        hit = tuple(takewhile(_is_block, map(self.pool.cached.get, block_hashes[:max_blocks])))
        return PrefixMatch(hit, len(hit) * self.block_size, num_tokens, self.pool.epoch)

    # -------------------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        num_computed_tokens: int = 0,
        prefix: PrefixMatch | None = None,
        block_hashes: Sequence[bytes] = (),
        stat_sources: Iterable[tuple] = (),
        num_lookahead_tokens: int = 0,
    ) -> SlotAllocation | None:
        """Make room for ``num_new_tokens`` more tokens of a request, all or nothing.

        With ``num_lookahead_tokens`` (speculative decoding: the proposal tokens a step
        verifies), that many more slots follow the new tokens in the same all-or-nothing
        allocation. They are never hashed or cached here (only blocks full of verified tokens
        are); once the step has verified them, :meth:`trim` gives back the blocks that hold
        only rejected ones (vLLM v1's lookahead slots).

        Args:
            request_id: The request (or forked sequence).
            num_new_tokens: Tokens the step will compute and write (>= 0).
            num_computed_tokens: Tokens whose KV the request's held blocks already hold.
            prefix: For a request that holds no blocks yet: the match from
                :meth:`get_computed_blocks`; its blocks are taken (and its stats recorded).
            block_hashes: The request's block hashes so far; every block that is full after
                this step and has a hash is registered in the prefix cache.
            stat_sources: Labels to split the hit-rate statistics by (with ``prefix``).
            num_lookahead_tokens: Extra slots after the new tokens, for proposal tokens.

        Returns:
            The blocks appended and the copies to make, or None when the pool cannot fit the
            request right now (then nothing changed: no reference taken, nothing evicted).

        Raises:
            ValueError: negative counts, a prefix for a request that already holds blocks,
                ``num_computed_tokens`` beyond the held blocks, or a stale prefix (a matched
                block evicted since the lookup).
        """
        if num_new_tokens < 0 or num_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be >= 0")
        bs = self.block_size
        state = self._requests.get(request_id)
        held = state.blocks if state is not None else []
        if num_computed_tokens > len(held) * bs:
            raise ValueError(
                f"request {request_id!r} holds {len(held)} blocks, fewer than "
                f"num_computed_tokens={num_computed_tokens} needs"
            )
        hit_blocks: tuple[KVCacheBlock, ...] = ()
        if prefix is not None and prefix.blocks:
            if held or num_computed_tokens:
                raise ValueError(f"request {request_id!r} already holds blocks; no prefix allowed")
            hit_blocks = prefix.blocks
            if prefix.pool_epoch != self.pool.epoch:
                self._check_still_cached(hit_blocks, block_hashes)
        total = num_computed_tokens + len(hit_blocks) * bs + num_new_tokens  # verified tokens
        num_fresh = max(0, -(-(total + num_lookahead_tokens) // bs) - len(held) - len(hit_blocks))
        # Copy on write: the first token goes into a held partial block another sequence shares.
        cow_index = -1
        if (num_new_tokens or num_lookahead_tokens) and num_computed_tokens % bs:
            idx = num_computed_tokens // bs
            if idx < len(held) and held[idx].ref_cnt > 1:
                cow_index = idx
        needed = num_fresh + (cow_index >= 0)
        # Hit blocks with ref count 0 sit in the free queue: reviving them uses free blocks.
        # Count them only when the bound that assumes all are free does not already fit.
        if needed > self.pool.num_free - len(hit_blocks):
            revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
            if needed > self.pool.num_free - revived:
                return None

        pool = self.pool
        if state is None:
            state = self._requests[request_id] = _RequestBlocks([])
            held = state.blocks
        result = SlotAllocation()
        if hit_blocks:
            pool.touch(hit_blocks)
            held.extend(hit_blocks)
            state.num_cached_blocks = len(hit_blocks)
            result.new_block_ids.extend([b.block_id for b in hit_blocks])
        if prefix is not None and self.enable_caching:
            self.stats.record(prefix.num_queried_tokens, prefix.num_cached_tokens, stat_sources)
        if cow_index >= 0:
            (copy,) = pool.get_new_blocks(1)
            src = held[cow_index]
            held[cow_index] = copy
            pool.free_blocks((src,))
            result.copies.append(BlockCopy(cow_index, src.block_id, copy.block_id))
        if num_fresh:
            fresh = pool.get_new_blocks(num_fresh)
            held.extend(fresh)
            result.new_block_ids.extend([b.block_id for b in fresh])
        if self.enable_caching:
            self._cache_full_blocks(state, min(total // bs, len(block_hashes)), block_hashes)
        return result

    @staticmethod
    def _check_still_cached(blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes]) -> None:
        """Raise ValueError when a matched block was evicted since the lookup."""
        if len(block_hashes) < len(blocks) or any(
            b.block_hash is None or b.block_hash != block_hashes[i] for i, b in enumerate(blocks)
        ):
            raise ValueError("stale prefix match: a matched block was evicted since the lookup")

    def _cache_full_blocks(
        self, state: _RequestBlocks, num_full: int, block_hashes: Sequence[bytes]
    ) -> None:
        """Register ``state.blocks[num_cached_blocks:num_full]`` under their hashes."""
        start = state.num_cached_blocks
        if num_full <= start:
            return
        cached = self.pool.cached
        stored: list[bytes] = []
        for block, h in zip(
            state.blocks[start:num_full], block_hashes[start:num_full], strict=True
        ):
            if block.block_hash is None and h not in cached:
                block.block_hash = h
                cached[h] = block
                stored.append(h)
        state.num_cached_blocks = num_full
        if stored and self.events is not None:
            self.events.stored(stored)

    def trim(self, request_id: str, num_tokens: int) -> list[int]:
        """Keep only the blocks that ``num_tokens`` tokens need; give back the rest.

        After a speculative step: the blocks past the last accepted token held only rejected
        proposal tokens (lookahead slots); they return to the pool, tail first. They were never
        cached, so they go to the front of the free queue (the first to be reused).

        Args:
            request_id: The request (or forked sequence).
            num_tokens: Tokens whose KV the request keeps (its computed tokens).

        Returns:
            The physical ids given back, in logical order (empty when nothing was past them).

        Raises:
            ValueError: ``num_tokens`` is negative.
        """
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        state = self._requests.get(request_id)
        if state is None:
            return []
        keep = -(-num_tokens // self.block_size)
        tail = state.blocks[keep:]
        if not tail:
            return []
        del state.blocks[keep:]
        self.pool.free_blocks(tail[::-1])
        state.num_cached_blocks = min(state.num_cached_blocks, keep)
        return [b.block_id for b in tail]

    # -------------------------------------------------------------------- fork and free
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's whole block table, sharing every block (n > 1).

        The shared partial last block is copied on the first write by either sequence
        (:meth:`allocate_slots` returns the copy).

        Raises:
            KeyError: the parent holds no blocks.
            ValueError: the child already holds blocks.
        """
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"request {parent_id!r} holds no blocks")
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already holds blocks")
        for block in parent.blocks:
            block.ref_cnt += 1
        self._requests[child_id] = _RequestBlocks(list(parent.blocks), parent.num_cached_blocks)

    def free(self, request_id: str) -> int:
        """Release every block of a finished, aborted or preempted request, tail first.

        Blocks whose ref count reaches 0 return to the free queue; cached ones stay cached
        until evicted. Freeing a request that holds no blocks does nothing.

        Returns:
            The number of blocks released.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return 0
        self.pool.free_blocks(state.blocks[::-1])
        return len(state.blocks)

    def uncache_from(self, request_id: str, first_block: int) -> list[int]:
        """Forget the cached hashes of the request's blocks from logical index ``first_block``.

        For a step that failed while computing them: their KV may be partly written, so no
        request may hit them again. Blocks before ``first_block`` (a prefix hit, or computed by
        earlier steps) keep their hashes.

        Returns:
            The physical ids of the blocks from ``first_block`` on (hash dropped or not).
        """
        state = self._requests.get(request_id)
        if state is None:
            return []
        tail = state.blocks[first_block:]
        self.pool.uncache(tail)
        state.num_cached_blocks = min(state.num_cached_blocks, first_block)
        return [b.block_id for b in tail]

    # ------------------------------------------------------------- KV tier transfers
    def pin_cached(self, block_hashes: Sequence[bytes]) -> list[KVCacheBlock]:
        """Take a reference on the cached block of each hash, outside any request.

        For a KV transfer that reads blocks off the step (an offload to the KV tiers): a
        pinned block is neither evicted nor reused until :meth:`unpin`. Hashes not cached
        are skipped.

        Returns:
            The pinned blocks, in the order of ``block_hashes`` (missing ones left out).
        """
        cached = self.pool.cached
        blocks = [b for b in map(cached.get, block_hashes) if b is not None]
        self.pool.touch(blocks)
        self.num_pinned += len(blocks)
        return blocks

    def pin_new(self, n: int) -> list[KVCacheBlock] | None:
        """Take ``n`` fresh blocks outside any request (a KV tier load writes into them).

        Returns:
            The blocks (ref count 1, no hash), or None when fewer than ``n`` are free.
        """
        if n > self.pool.num_free:
            return None
        blocks = self.pool.get_new_blocks(n)
        self.num_pinned += n
        return blocks

    def register_loaded(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes]) -> int:
        """Register pinned fresh blocks, whose KV a tier load wrote, under their hashes.

        A hash already cached (another request computed it meanwhile) keeps its block; the
        loaded copy stays unhashed and returns to the front of the free queue on unpin.

        Returns:
            How many blocks were registered.
        """
        if not self.enable_caching:
            return 0
        cached = self.pool.cached
        stored: list[bytes] = []
        for block, h in zip(blocks, block_hashes, strict=True):
            if block.block_hash is None and h not in cached:
                block.block_hash = h
                cached[h] = block
                stored.append(h)
        if stored and self.events is not None:
            self.events.stored(stored)
        return len(stored)

    def unpin(self, ordered: Sequence[KVCacheBlock]) -> None:
        """Drop the references :meth:`pin_cached` or :meth:`pin_new` took.

        Args:
            ordered: The blocks in eviction priority order (a prefix tail first), as
                :meth:`free`.
        """
        self.pool.free_blocks(ordered)
        self.num_pinned -= len(ordered)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False, nothing changes) while blocks are in use."""
        return self.pool.reset_prefix_cache()
