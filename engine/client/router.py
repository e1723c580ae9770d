"""Choose a replica for a request: prefill it would save, adapter residency, queued work.

Each healthy replica is scored in tokens of work::

    score = block_size * leading_hits             prefill the replica's cache saves
          + tier_weight * block_size * tier_hits  ... and its own KV tiers (loaded, not free)
          + adapter_load_tokens * resident        an adapter already in a device slot
          - load_weight * outstanding_tokens      work already queued on it

and the best one is taken, unless its queue is longer than the shortest by more than
``imbalance_tokens`` and ``imbalance_ratio`` times the shortest: then the least-loaded replica
gets the request (SGLang's router falls back the same way, with request counts). Ties go to
the least loaded, then to the first name. Ray Serve LLM's ``PrefixCacheAffinityRouter`` and
SGLang's router match an approximate prefix tree of the text; here the hashes are the
engines' own (``hashing.hash_block`` with the adapter, images and tenant salt), so a match is
exact and a tenant's blocks never count for another tenant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.engine.client.replica_view import ReplicaView


class NoReplicaError(RuntimeError):
    """No replica is healthy (the gateway answers 503)."""


@dataclass(frozen=True)
class RoutingPolicy:
    """The router's weights.

    Attributes:
        block_size: Tokens per KV block (the engines').
        adapter_load_tokens: What loading an adapter into a device slot is worth, in tokens
            of prefill (a copy of its weights, and a slot taken from another adapter).
        load_weight: Weight of one queued token against one token of prefill saved: a
            replica's queued tokens delay a new request by much less than their number (in a
            continuous batch the new request runs alongside them), so 0.125 by default
            (``bench.scale``: 0.96 of the one-big-pool hit rate at 0.125, 0.94 at 0.25,
            with the requests still split evenly).
        tier_weight: Weight of a block in a replica's own KV tiers (host memory, disk)
            against one in its pool: loading it back costs a fraction of recomputing it
            (``bench.kv_tiers``: 0.06-0.07x on the CPU), but is not free. A store shared by
            every replica counts the same for all, so it never changes the choice.
        imbalance_tokens: Queued tokens above the least-loaded replica's past which...
        imbalance_ratio: ... and past this multiple of it, least-loaded wins outright.
        policy: ``"cache"`` (the score above), ``"round_robin"`` or ``"least_loaded"``
            (the baselines ``bench.scale`` compares against).

    Raises:
        ValueError: an unknown ``policy``.
    """

    block_size: int = 16
    adapter_load_tokens: int = 256
    load_weight: float = 0.125
    tier_weight: float = 0.5
    imbalance_tokens: int = 4096
    imbalance_ratio: float = 2.0
    policy: str = "cache"

    def __post_init__(self) -> None:
        if self.policy not in ("cache", "round_robin", "least_loaded"):
            raise ValueError(f"unknown routing policy {self.policy!r}")


class Router:
    """Routes requests between replicas and keeps their views.

    Args:
        names: The replicas.
        policy: The weights and policy.

    Raises:
        ValueError: no replica, or a name given twice.
    """

    def __init__(self, names: Sequence[str], policy: RoutingPolicy | None = None) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError("need one or more distinct replica names")
        self.policy = policy or RoutingPolicy()
        self.views = {name: ReplicaView(name) for name in names}
        self._next = 0  # round robin

    def choose(self, block_hashes: Sequence[bytes], adapter: str | None = None) -> str:
        """The replica a request with these block hashes and adapter should go to.

        Raises:
            NoReplicaError: every replica is unhealthy.
        """
        healthy = [v for v in self.views.values() if v.healthy]
        if not healthy:
            raise NoReplicaError("no engine replica is available")
        p = self.policy
        if p.policy == "round_robin":
            view = healthy[self._next % len(healthy)]
            self._next += 1
            return view.name
        least = min(healthy, key=lambda v: v.outstanding_tokens)
        if p.policy == "least_loaded":
            return least.name

        def score(v: ReplicaView) -> float:
            resident = adapter is not None and adapter in v.adapters
            pool, tier = v.leading_tier_hits(block_hashes)
            return (
                p.block_size * (pool + p.tier_weight * tier)
                + p.adapter_load_tokens * resident
                - p.load_weight * v.outstanding_tokens
            )

        best = max(healthy, key=lambda v: (score(v), -v.outstanding_tokens))
        floor = least.outstanding_tokens
        if best.outstanding_tokens - floor > max(p.imbalance_tokens, p.imbalance_ratio * floor):
            return least.name
        return best.name

    def started(self, name: str, num_tokens: int) -> None:
        """A request of ``num_tokens`` (prompt + ``max_tokens``) was sent to ``name``."""
        self.views[name].outstanding_tokens += num_tokens

    def finished(self, name: str, num_tokens: int) -> None:
        """That request ended (any way)."""
        view = self.views[name]
        view.outstanding_tokens = max(0, view.outstanding_tokens - num_tokens)

    def set_healthy(self, name: str, healthy: bool) -> None:
        """Take a replica out of routing (dead, restarting) or put it back.

        A replica taken out forgets its view: a restarted engine's cache starts empty.
        """
        view = self.views[name]
        if not healthy:
            view.reset()
        view.healthy = healthy
