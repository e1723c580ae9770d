"""Verification of proposals: which ones the target model keeps, with its distribution exact.

A speculating sequence's step computes the target's logits at ``k + 1`` positions: after its
last token, and after each of its ``k`` proposals ``x_1 .. x_k``. The sampler draws the
target's token ``t_i`` at every position exactly as a plain decode step would (greedy argmax,
or the exponential race with the sequence's own noise, after the same penalties, which see
the proposals before position ``i`` as output). The step keeps ``t_0 .. t_a`` where ``a`` is
the number of leading proposals with ``x_i == t_{i-1}``: the agreeing proposals, then the
target's own token at the first disagreement (or the bonus token after ``k`` agreements).

This is the rejection sampling of Leviathan et al. 2023 (arXiv:2211.17192) and Chen et al.
2023 (arXiv:2302.01318) for a deterministic proposer, whose draft distribution ``q`` is a point
mass on ``x``: the proposal is accepted with probability ``min(1, p(x) / q(x)) = p(x)``, which
is the probability that ``t ~ p`` equals ``x``; on rejection the token comes from
``norm(max(0, p - q))``, which is ``p`` conditioned on ``t != x``, the law of ``t`` given that
it differs. Every kept token is therefore a draw of the target distribution given the tokens
before it, and since ``t_i`` uses the noise a plain step at that position would use, a seeded
request's output is the same token for token with speculation on or off: the rows drawn past
the first rejection are given back (:func:`rewind_generator`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accepted_prefix(proposals: Sequence[int], target_tokens: Sequence[int]) -> int:
    """How many leading proposals the target agrees with.

    Args:
        proposals: ``[k]`` proposed token ids ``x_1 .. x_k``.
        target_tokens: ``[k + 1]`` the target's tokens ``t_0 .. t_k`` at the positions after
            the last real token and after each proposal.

    Returns:
        ``a`` in ``[0, k]``: ``x_i == t_{i-1}`` for ``i <= a``; the step keeps
        ``target_tokens[: a + 1]``.

    Raises:
        ValueError: ``len(target_tokens) != len(proposals) + 1``.
    """
    if len(target_tokens) != len(proposals) + 1:
        raise ValueError(
            f"{len(proposals)} proposals need {len(proposals) + 1} target tokens, "
            f"got {len(target_tokens)}"
        )
    a = 0
    for x, t in zip(proposals, target_tokens, strict=False):
        if x != t:
            break
        a += 1
    return a


def rewind_generator(
    generator: torch.Generator, state: torch.Tensor, num_rows: int, vocab_size: int
) -> None:
    """Put a sequence's generator where ``num_rows`` plain decode steps would have left it.

    The sampler drew ``k + 1`` rows of ``vocab_size`` exponentials from the generator (one per
    verified position); only the first ``num_rows`` were kept. The generator goes back to
    ``state`` (taken before the step) and draws those rows again, as the plain steps would
    have, so the next step's noise is the same with speculation on or off.

    Args:
        generator: The sequence's own generator.
        state: ``generator.get_state()`` before the step.
        num_rows: Kept positions (``a + 1``).
        vocab_size: Exponentials per row (the logits' width).
    """
    generator.set_state(state)
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_rows):
        scratch.exponential_(generator=generator)
