"""A router's mirror of one replica: the block hashes and adapters it holds, and its load.

Built from the replica's KV events (``engine.kv_cache.events``) in the order it published them. The
view can only be behind the replica, never ahead of it in a way that matters: a hash the view
lacks costs a missed routing opportunity, a hash it still has after an eviction sends a
request to a replica that recomputes a block it hoped to reuse. Neither changes an output.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any


class ReplicaView:
    """What the router believes one replica holds.

    Args:
        name: The replica's name (the key the router answers with).

    Attributes:
        hashes: Block hashes it holds in its prefix cache.
        adapters: Adapter digests resident in its device slots.
        healthy: False while it is dead or restarting (never chosen then).
        outstanding_tokens: Prompt plus ``max_tokens`` of the requests routed to it and not
            finished yet: the work queued on it, in tokens.
        num_events: Events applied (for tests and metrics).
        tier_capacity_blocks: Blocks its own KV tiers (host memory and disk, not a store
            shared by every replica) hold; 0: none, None: not known yet.
        tier_hashes: Block hashes believed in those tiers, least recently stored first:
            every hash the replica stored (its tiers are written through), bounded by
            ``tier_capacity_blocks`` as their LRU is. An estimate: the tiers' own evictions
            are not published.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.hashes: set[bytes] = set()
        self.adapters: set[str] = set()
        self.healthy = True
        self.outstanding_tokens = 0
        self.num_events = 0
        self.tier_capacity_blocks: int | None = None
        self.tier_hashes: OrderedDict[bytes, None] = OrderedDict()

    def apply(self, events: Iterable[Any]) -> None:
        """Apply the replica's events (``engine.kv_cache.events.KVEvent``), oldest first."""
        for event in events:
            self.num_events += 1
            kind = event.kind
            if kind == "stored":
                self.hashes.update(event.block_hashes)
                self._tier_store(event.block_hashes)
            elif kind == "removed":
                self.hashes.difference_update(event.block_hashes)
            elif kind == "cleared":
                self.hashes.clear()
            elif kind == "lora_loaded":
                self.adapters.add(event.adapter)
            elif kind == "lora_unloaded":
                self.adapters.discard(event.adapter)

    def _tier_store(self, block_hashes: Iterable[bytes]) -> None:
        cap = self.tier_capacity_blocks
        if not cap:
            return
        tier = self.tier_hashes
        for h in block_hashes:
            tier[h] = None
            tier.move_to_end(h)
        while len(tier) > cap:
            tier.popitem(last=False)

    def leading_tier_hits(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """Leading blocks held in the pool, then in its own tiers after the pool's run.

        Returns:
            ``(pool, tier)``: the engine loads the ``tier`` blocks that follow the ``pool``
            ones before it prefills the rest.
        """
        pool = self.leading_hits(block_hashes)
        tier = 0
        if self.tier_hashes:
            for h in block_hashes[pool:]:
                if h not in self.tier_hashes:
                    break
                tier += 1
        return pool, tier

    def reset(self) -> None:
        """Forget the pool (the replica died: a restarted one starts with an empty pool).

        Its disk tier survives a restart, its host tier does not: both are forgotten here, so
        the view can only underestimate.
        """
        self.hashes.clear()
        self.tier_hashes.clear()
        self.adapters.clear()

    def leading_hits(self, block_hashes: Sequence[bytes]) -> int:
        """How many of a request's leading blocks the replica holds.

        A prefix match stops at the first miss, as the engine's lookup does.
        """
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n
