"""Speculative decoding: proposers, the adaptive number of proposals, verification.

A speculating sequence's decode step computes ``k + 1`` positions (its last token and ``k``
proposed tokens, in lookahead slots of the KV cache: ``KVCacheManager.allocate_slots``) in
the same forward pass as every other sequence's decode or prefill chunk, samples the target
model's token at each of them, keeps the longest prefix of proposals that agrees plus the
target's next token, and gives back the slots of the rejected ones (``KVCacheManager.trim``).
docs/speculative.md has the whole design.
"""

from loraplex.engine.spec_decode.adaptive import AdaptiveK, SpecDecodeStats
from loraplex.engine.spec_decode.ngram import NgramProposer
from loraplex.engine.spec_decode.verify import accepted_prefix

__all__ = ["AdaptiveK", "NgramProposer", "SpecDecodeStats", "accepted_prefix"]
