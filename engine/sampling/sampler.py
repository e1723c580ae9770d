"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

One step samples one token for each of ``N`` rows (``logits: [N, V]``), each row with its own
:class:`~engine.sampling.params.SamplingParams` and optional :class:`torch.Generator`.

Pipeline for a random row (the order of Hugging Face's logits warpers)::

    x      = processors(logits)  logit_bias, min_tokens, repetition / frequency / presence
                        penalties, for the rows that ask (``engine.sampling.penalties``)
    x      = x / temperature
    x      = top_k(x)   drop x_i < (k-th largest x); ties at the k-th value are kept
                        (HF ``TopKLogitsWarper``, vLLM)
    x      = top_p(x)   sort descending; keep token i iff the probability of the tokens before
                        it is < top_p: the smallest set whose mass is >= top_p; the top token is
                        always kept (nucleus sampling, Holtzman et al. 2019, arXiv:1904.09751)
    p      = softmax(x)
    p      = min_p(p)   drop p_i < min_p * max(p) (Nguyen et al. 2024, arXiv:2407.01082)
    token  = argmax(p / q),  q ~ Exp(1) iid of shape [V] from the row's generator

The last line is the exponential race (vLLM's ``random_sample``, the Gumbel-max trick in
another guise): ``q_i / p_i ~ Exp(p_i)`` and the minimum of independent exponentials is
attained at ``i`` with probability ``p_i / sum(p)``, so no renormalization is needed. All of it
is vectorized over the batch; the only per-row Python loop draws ``q`` from the row's generator.

**Seeding.** A seeded row draws its ``V`` exponentials from its own generator and uses only its
own probabilities, so its tokens are the same whatever the batch's size, order or other rows
(up to the float arithmetic of ``softmax`` being row-independent, which it is on CPU). Unseeded
rows draw one ``[R, V]`` block from the sampler's shared generator (or torch's global RNG).
Greedy rows (temperature 0) take ``argmax`` of the processed logits (ties -> lowest index)
and consume no randomness.

**Logprobs** are those of the raw model distribution, ``log_softmax(logits)`` before temperature
and filtering (vLLM's default ``raw_logprobs``; what OpenAI reports): see
:func:`engine.sampling.logprobs.gather_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.engine.sampling.logprobs import TopLogprobs, gather_logprobs
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.penalties import TokenHistory, apply_logits_processors

_Q_MIN = torch.finfo(torch.float32).tiny  # exponential_ may return 0; p / 0 would be inf or nan


@dataclass(frozen=True)
class SamplerOutput:
    """One step's result, one entry per input row, in input order.

    Attributes:
        token_ids: The sampled token of each row.
        logprobs: ``log_softmax(raw logits)`` of the sampled token; None where the row's
            ``params.logprobs`` is None.
        ranks: Rank of the sampled token in the raw distribution (1 = most likely; ties share
            the better rank); None where logprobs were not asked for.
        top_logprobs: The ``params.logprobs`` most likely ``(token_id, logprob)`` pairs, sorted
            by logprob descending (empty for 0); None where logprobs were not asked for.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top_logprobs: list[TopLogprobs | None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request (or one child of an ``n > 1`` request).

    Args:
        seed: ``SamplingParams.seed`` (any int; reduced modulo 2**64).
        device: Must be the device the logits live on.

    Returns:
        A fresh ``torch.Generator`` seeded with ``seed``.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**64)
    return gen


def filter_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampling distribution after temperature, top-k, top-p and min-p.

    A filter given as None is off for every row, which skips its work (and the sort, when both
    top-k and top-p are None). No host-device synchronization happens here.

    Args:
        logits: ``[N, V]`` float32 raw logits.
        temperature: ``[N]`` float32, > 0.
        top_k: ``[N]`` int64; ``<= 0`` or ``>= V`` disables it for the row.
        top_p: ``[N]`` float32 in ``(0, 1]``; 1 disables it for the row.
        min_p: ``[N]`` float32 in ``[0, 1]``; 0 disables it for the row.

    Returns:
        ``[N, V]`` float32 probabilities, each row summing to 1, dropped tokens exactly 0.
    """
    x = logits / temperature.unsqueeze(1)
    vocab = x.shape[1]
    if top_k is not None or top_p is not None:
        # Filter in sorted space, then scatter the drop mask back: kept logits are untouched, so
        # a row without top-k / top-p is bit-identical whether or not its batch needed the sort.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if top_k is not None:
            use_k = ((top_k > 0) & (top_k < vocab)).unsqueeze(1)
            k = top_k.clamp(1, vocab).unsqueeze(1)
            kth = sorted_x.gather(1, k - 1)  # [N, 1]
            drop |= (sorted_x < kth) & use_k  # ties at the k-th value are kept
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        if top_p is not None:
            probs = sorted_x.softmax(dim=-1)
            before = torch.cumsum(probs, dim=-1)  # mass of the tokens before each one:
            before = torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1]], dim=1)
            drop_p = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
            drop_p[:, 0] = False  # the top token always survives
            drop |= drop_p
        x = x.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))
    probs = x.softmax(dim=-1)
    if min_p is not None:
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)  # min_p = 0: nothing is < 0
        # Renormalize only the rows min-p touched: the others stay bit-identical.
        probs = torch.where((min_p > 0).unsqueeze(1), probs / probs.sum(-1, keepdim=True), probs)
    return probs


def exponential_race(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row from ``probs`` with the exponential race.

    Args:
        probs: ``[N, V]`` float32 non-negative weights (need not be normalized).
        generators: ``N`` entries: the row's own generator, or None for the shared one.
        default_generator: Shared generator for rows without one; None means torch's global RNG.

    Returns:
        ``[N]`` int64 token ids: ``argmax_i probs[r, i] / q[r, i]`` with ``q ~ Exp(1)``.
    """
    q = torch.empty_like(probs)
    shared = [r for r, gen in enumerate(generators) if gen is None]
    if len(shared) == len(generators):
        q.exponential_(generator=default_generator)
    elif shared:
        block = torch.empty((len(shared), probs.shape[1]), dtype=q.dtype, device=q.device)
        q[shared] = block.exponential_(generator=default_generator)
    for r, gen in enumerate(generators):
        if gen is not None:
            q[r].exponential_(generator=gen)  # exactly V draws from the row's own stream
    return (probs / q.clamp_min_(_Q_MIN)).argmax(dim=-1)


class Sampler:
    """Samples one token per row of a batch of logits.

    Args:
        generator: Shared generator for unseeded rows (seed it from the engine's ``--seed``);
            None means torch's global RNG. Must live on the logits' device.
        eos_token_ids: The model's EOS ids (``min_tokens`` keeps them from being sampled).
    """

    def __init__(
        self, generator: torch.Generator | None = None, eos_token_ids: Sequence[int] = ()
    ) -> None:
        self.generator = generator
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        default_generator: torch.Generator | None = None,
        histories: Sequence[TokenHistory | None] | None = None,
    ) -> SamplerOutput:
        """Sample one token for each row.

        Args:
            logits: ``[N, V]`` raw logits of the last position of each sequence (any float
                dtype; computed in float32).
            params: ``N`` sampling params, row ``r`` sampled with ``params[r]``.
            generators: ``N`` per-row generators (``make_generator(params.seed)`` for seeded
                rows, kept across steps by the caller), or None for all-shared.
            default_generator: Shared generator for this call's unseeded rows, overriding the
                one given at construction.
            histories: ``N`` token histories (prompt and output so far), needed by rows with
                penalties or ``min_tokens``; None when no row needs one.

        Returns:
            A :class:`SamplerOutput` with ``N`` entries in row order; logprobs are those of
            the raw ``logits``.

        Raises:
            ValueError: ``logits`` is not 2-D, the lengths of ``params`` / ``generators`` /
                ``histories`` differ from ``N``, or a row that needs its history has none.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if generators is None:
            generators = [None] * num_rows
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"got {num_rows} logit rows, {len(params)} params, {len(generators)} generators"
            )
        logits = logits.float()
        scores = apply_logits_processors(
            logits,
            params,
            histories if histories is not None else [None] * num_rows,
            self.eos_token_ids,
        )
        device = logits.device
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy = [r for r, p in enumerate(params) if p.greedy]
        rand = [r for r, p in enumerate(params) if not p.greedy]
        if greedy:
            idx = torch.tensor(greedy, dtype=torch.long, device=device)
            token_ids[idx] = scores[idx].argmax(dim=-1)
        if rand:
            idx = torch.tensor(rand, dtype=torch.long, device=device)
            sub = [params[r] for r in rand]
            probs = filter_probs(
                scores[idx],
                temperature=_column([p.temperature for p in sub], torch.float32, device),
                top_k=_column([p.top_k for p in sub], torch.long, device, off=(0, -1)),
                top_p=_column([p.top_p for p in sub], torch.float32, device, off=(1.0,)),
                min_p=_column([p.min_p for p in sub], torch.float32, device, off=(0.0,)),
            )
            shared = default_generator if default_generator is not None else self.generator
            token_ids[idx] = exponential_race(probs, [generators[r] for r in rand], shared)
        lps, ranks, tops = gather_logprobs(logits, token_ids, [p.logprobs for p in params])
        return SamplerOutput(token_ids.tolist(), lps, ranks, tops)


def _column(
    values: list, dtype: torch.dtype, device: torch.device, off: tuple = ()
) -> torch.Tensor | None:
    """``values`` as a ``[R]`` tensor, or None when every value is one of ``off``."""
    if off and all(v in off for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)
