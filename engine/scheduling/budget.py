"""How much prefill work a step carries, and how it is shared between tenants.

Work is counted in token-equivalents: computing the token at position ``p`` costs
``1 + p * attention_cost``, where ``attention_cost = 1 / alpha`` is a token's attention work per
context position over the rest of its forward pass (``engine.core.engine_core.attention_cost``
derives it from the model's shapes; context length weighs on small models far more).

A step's prefill work is the whole token budget; at most ``long_prefill_token_threshold``
while a running sequence decodes (its next token waits for the step: Sarathi-Serve's
stall-free batching); and at most ``tenant_prefill_tokens`` while more than one tenant has work
(what another tenant's long prompts may add to a step a tenant waits for). It is shared max-min
fairly between the tenants that want some (water-filling): a tenant wanting less than an equal
share gets all it wants, the others split the rest. While shared, a tenant's work is one chunk
of one sequence per step: each chunk gathers its whole context, so many small chunks of long
prompts cost more than their tokens say.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from loraplex.engine.scheduling.fair_queue import FairQueue, priority_of, tenant_of
from loraplex.engine.sequence import Sequence


class PrefillBudget:
    """The per-step prefill allowance of each tenant (see the module docstring).

    Args:
        max_num_batched_tokens: Token budget of a step.
        long_prefill_token_threshold: Most prefill work while a sequence decodes (0: no cap).
        tenant_prefill_tokens: Most prefill work while more than one tenant has work (0: no
            cap).
        attention_cost: ``1 / alpha`` (0: every token costs 1).
    """

    def __init__(
        self,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
        tenant_prefill_tokens: int = 0,
        attention_cost: float = 0.0,
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.tenant_prefill_tokens = tenant_prefill_tokens
        self.attention_cost = attention_cost

    def allowance(
        self,
        running: Iterable[Sequence],
        waiting: FairQueue,
        max_num_seqs: int,
        priority: int | None = None,
        cap: int = 0,
    ) -> tuple[dict[str, float], bool]:
        """Prefill work each tenant may do this step, and whether it is shared.

        Args:
            running: The running sequences.
            waiting: The waiting queue (its first ``max_num_seqs`` prompts per tenant count).
            max_num_seqs: How many waiting prompts of a tenant to count.
            priority: Count only the sequences of this class (``EngineRequest.priority``),
                running and waiting: the allowance of a step that class takes alone (the
                interactive pass of ``Scheduler._schedule``). None: every class.
            cap: Most prefill work in all (0: no cap beyond the budget's own).

        Returns:
            ``tenant -> allowance`` (token-equivalents) and whether more than one tenant has
            work.
        """
        running = [s for s in running if priority is None or priority_of(s) == priority]
        demand: dict[str, float] = {}
        decoding = False
        for s in running:
            remaining = s.num_tokens - s.num_computed_tokens
            if remaining > 1:
                t = tenant_of(s)
                demand[t] = demand.get(t, 0.0) + self.cost(s.num_computed_tokens, remaining)
            elif remaining == 1:
                decoding = True
        queued = waiting.demand(max_num_seqs, lambda q: self.cost(0, q.num_tokens), priority)
        for t, work in queued.items():
            demand[t] = demand.get(t, 0.0) + work
        total = float(self.max_num_batched_tokens)
        active = waiting.running.keys() if priority is None else {tenant_of(s) for s in running}
        shared = bool(self.tenant_prefill_tokens) and len(demand.keys() | active) > 1
        if decoding and self.long_prefill_token_threshold:
            total = min(total, float(self.long_prefill_token_threshold))
        if shared:
            total = min(total, float(self.tenant_prefill_tokens))
        if cap:
            total = min(total, float(cap))
        allowance: dict[str, float] = {}
        left = total
        ordered = sorted(demand.items(), key=lambda kv: kv[1])
        for k, (t, want) in enumerate(ordered):
            give = min(want, left / (len(ordered) - k))
            allowance[t] = give
            left -= give
        return allowance, shared

    def cost(self, start: int, n: int) -> float:
        """Work of computing positions ``[start, start + n)``: ``n`` plus their attention."""
        return n + self.attention_cost * (n * start + n * (n + 1) / 2)

    def tokens_within(self, start: int, most: int, allowance: float) -> int:
        """The most tokens from ``start`` (up to ``most``) whose work fits ``allowance``.

        At least one when the allowance covers half a token's work, so a prefill far into a
        long context still advances under a small cap.
        """
        if allowance <= 0 or most <= 0:
            return 0
        a = self.attention_cost
        if a == 0.0:
            n = int(allowance)
        else:  # a/2 n^2 + (1 + a (start + 1/2)) n <= allowance
            b = 1.0 + a * (start + 0.5)
            n = int((math.sqrt(b * b + 2.0 * a * allowance) - b) / a)
        if self.cost(start, n + 1) <= allowance * (1 + 1e-9):  # the root's rounding
            n += 1
        if n == 0 and allowance >= self.cost(start, 1) / 2:
            n = 1
        return min(most, n)
