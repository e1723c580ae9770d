"""Logits processors that need a sequence's tokens: penalties, ``logit_bias``, ``min_tokens``.

They run on the raw logits of the rows that ask for them, before temperature and the filters
of :mod:`engine.sampling.sampler`, in vLLM's order::

    x = logits + logit_bias                                   (OpenAI)
    x[eos, stop_token_ids] = -inf   while len(output) < min_tokens   (vLLM)
    x = where(seen, where(x > 0, x / r, x * r), x)            repetition penalty r (Keskar et
                                                              al. 2019, CTRL; HF, vLLM): seen =
                                                              in the prompt or the output
    x = x - frequency * count - presence * (count > 0)        (OpenAI; count over the output)

Everything is batched and sparse: the rows' tokens become distinct ``(row, token)`` pairs with
their counts (``torch.unique`` over one key tensor), and the logits at those pairs are gathered,
changed and put back in one ``index_put_`` per processor; per-row values are columns indexed by
pair. The work grows with the number of tokens, not rows x vocabulary, and the only Python loops
are over the rows and their token lists, never over the vocabulary. Rows that ask for none of it
are not touched (bit-identical to a batch without processors), and the logprobs a request gets
stay those of the raw logits (vLLM's default), computed by the sampler from its input.
``python -m bench.penalties`` measures the worst case (every row penalised) against none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from loraplex.engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """One row's tokens so far.

    Attributes:
        token_ids: The prompt's tokens, then the output's (the runner's list; not copied).
        num_prompt_tokens: How many of ``token_ids`` are the prompt.
        prompt_tensor: ``[num_prompt_tokens]`` int64 on the logits' device: the prompt, kept
            by the caller across steps so a long prompt is not converted at every step;
            None to read it from ``token_ids``.
    """

    token_ids: Sequence[int]
    num_prompt_tokens: int
    prompt_tensor: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens


def needs_history(params: SamplingParams) -> bool:
    """True when ``params`` can only be applied knowing the row's tokens."""
    return params.penalized or params.min_tokens > 0


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    eos_token_ids: Iterable[int] = (),
) -> torch.Tensor:
    """The logits the sampler draws from, after penalties, ``logit_bias`` and ``min_tokens``.

    Args:
        logits: ``[N, V]`` float32 raw logits (not modified).
        params: ``N`` sampling params.
        histories: ``N`` token histories; may be None for a row whose params need none
            (:func:`needs_history`).
        eos_token_ids: The model's EOS ids, masked by ``min_tokens`` unless ``ignore_eos``.

    Returns:
        ``logits`` itself when no row asks for processing, else a new ``[N, V]`` float32
        tensor whose unprocessed rows equal ``logits``'.

    Raises:
        ValueError: a row needs its history and has none, or the lengths differ.
    """
    if len(params) != logits.shape[0] or len(histories) != logits.shape[0]:
        raise ValueError(
            f"got {logits.shape[0]} rows, {len(params)} params, {len(histories)} histories"
        )
    rows = [r for r, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    for r in rows:
        if histories[r] is None and needs_history(params[r]):
            raise ValueError(f"row {r} needs its token history (penalties or min_tokens)")
    device = logits.device
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits.index_select(0, idx)  # [R, V], a copy
    sub_params = [params[r] for r in rows]
    sub_hist = [histories[r] for r in rows]
    _logit_bias(sub, sub_params)
    _min_tokens(sub, sub_params, sub_hist, tuple(eos_token_ids))
    _repetition_penalty(sub, sub_params, sub_hist)
    _frequency_presence(sub, sub_params, sub_hist)
    return logits.index_copy(0, idx, sub)


def _index(pairs_rows: list[int], pairs_cols: list[int], device) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(pairs_rows, dtype=torch.long, device=device),
        torch.tensor(pairs_cols, dtype=torch.long, device=device),
    )


def _logit_bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, cols, vals = [], [], []
    for r, p in enumerate(params):
        if p.logit_bias:
            rows.extend([r] * len(p.logit_bias))
            cols.extend(p.logit_bias.keys())
            vals.extend(p.logit_bias.values())
    if rows:
        value = torch.tensor(vals, dtype=x.dtype, device=x.device)
        x.index_put_(_index(rows, cols, x.device), value, accumulate=True)


def _min_tokens(
    x: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None],
    eos: tuple[int, ...],
) -> None:
    rows, cols = [], []
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.min_tokens > 0 and h is not None and h.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            rows.extend([r] * len(stops))
            cols.extend(stops)
    if rows:
        x.index_put_(_index(rows, cols, x.device), torch.tensor(float("-inf"), device=x.device))


def _seen(
    which: list[int], histories: list[TokenHistory | None], prompt: bool, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct ``(row, token)`` pairs of the rows' tokens, and how often each occurs.

    Rows are given as their position in ``which`` (``which[k]`` is row ``k``'s index into
    ``histories``); with ``prompt`` the prompt counts too, else only the output. Sparse: the
    work is in the number of tokens, not rows x vocabulary.

    Returns:
        ``(rows, tokens, counts)``: three ``[U]`` int64 tensors, sorted by (row, token).
    """
    rows: list[int] = []
    cols: list[int] = []
    row_parts, col_parts = [], []  # cached prompt tensors, indexed without Python lists
    for k, r in enumerate(which):
        h = histories[r]
        if prompt and h.prompt_tensor is not None:
            row_parts.append(torch.full_like(h.prompt_tensor, k))
            col_parts.append(h.prompt_tensor)
            tokens = h.token_ids[h.num_prompt_tokens :]
        elif prompt:
            tokens = h.token_ids
        else:
            tokens = h.token_ids[h.num_prompt_tokens :]
        rows.extend([k] * len(tokens))
        cols.extend(tokens)
    r_idx, c_idx = _index(rows, cols, device)
    if row_parts:
        r_idx = torch.cat([r_idx, *row_parts])
        c_idx = torch.cat([c_idx, *col_parts])
    width = 1 << 32  # token ids and row indices are far below 2**31
    keys, counts = torch.unique(r_idx * width + c_idx, sorted=True, return_counts=True)
    return keys // width, keys % width, counts


def _repetition_penalty(
    x: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
) -> None:
    which = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not which:
        return
    rows, cols, _ = _seen(which, histories, prompt=True, device=x.device)
    if rows.numel() == 0:
        return
    penalty = torch.tensor(
        [params[r].repetition_penalty for r in which], dtype=x.dtype, device=x.device
    )[rows]
    at = (torch.tensor(which, dtype=torch.long, device=x.device)[rows], cols)
    logit = x[at]
    x.index_put_(at, torch.where(logit > 0, logit / penalty, logit * penalty))


def _frequency_presence(
    x: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
) -> None:
    which = [
        r for r, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not which:
        return
    rows, cols, counts = _seen(which, histories, prompt=False, device=x.device)
    if rows.numel() == 0:
        return
    freq = torch.tensor([params[r].frequency_penalty for r in which], device=x.device)[rows]
    pres = torch.tensor([params[r].presence_penalty for r in which], device=x.device)[rows]
    at = (torch.tensor(which, dtype=torch.long, device=x.device)[rows], cols)
    x.index_put_(at, x[at] - (freq * counts.to(x.dtype) + pres))
