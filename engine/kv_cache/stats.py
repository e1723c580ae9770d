"""Prefix-cache hit-rate statistics: queried vs hit tokens, overall and per extra-key source.

A *source* is a label a request carries from its extra keys (``("lora", digest)``,
``("salt", tenant)``, ``("mm", True)``; see ``RequestBlockHasher.stat_sources``), so one can
read a tenant's or an adapter's hit rate, not just the pool's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class HitCounts:
    """Token counts of prefix lookups.

    Attributes:
        requests: Lookups recorded (a preempted request that is looked up again counts twice).
        queried_tokens: Prompt tokens looked up.
        hit_tokens: Of those, tokens served from cached blocks.
    """

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens``, 0.0 before any query."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def add(self, queried: int, hit: int) -> None:
        """Record one lookup of ``queried`` tokens of which ``hit`` were cached."""
        self.requests += 1
        self.queried_tokens += queried
        self.hit_tokens += hit


@dataclass(slots=True)
class PrefixCacheStats:
    """Hit counts of the whole pool and split by source.

    Attributes:
        total: Every recorded lookup.
        by_source: One entry per source label seen, e.g. ``("lora", "9f2c...")``.
    """

    total: HitCounts = field(default_factory=HitCounts)
    by_source: dict[tuple, HitCounts] = field(default_factory=dict)

    def record(self, queried: int, hit: int, sources: Iterable[tuple] = ()) -> None:
        """Record one lookup under the total and under each of the request's sources.

        Raises:
            ValueError: ``hit`` is negative or more than ``queried``.
        """
        if not 0 <= hit <= queried:
            raise ValueError(f"hit tokens {hit} must be within [0, queried={queried}]")
        self.total.add(queried, hit)
        for source in sources:
            counts = self.by_source.get(source)
            if counts is None:
                counts = self.by_source[source] = HitCounts()
            counts.add(queried, hit)

    def hit_rate(self, source: tuple | None = None) -> float:
        """The hit rate overall, or of one source (0.0 for a source never seen)."""
        if source is None:
            return self.total.hit_rate
        counts = self.by_source.get(source)
        return counts.hit_rate if counts is not None else 0.0

    def reset(self) -> None:
        """Clear every count."""
        self.total = HitCounts()
        self.by_source.clear()
