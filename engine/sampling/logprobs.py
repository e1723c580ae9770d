"""Logprobs of sampled tokens and their top alternatives, and their OpenAI JSON shape.

Semantics: every logprob is ``log_softmax(raw_logits)``, the model's own distribution before
temperature, top-k, top-p and min-p (vLLM's default ``logprobs_mode="raw_logprobs"``; OpenAI
reports the model's distribution too). So a greedy and a sampled request report the same numbers
for the same token, and a token that a filter dropped can still appear among the alternatives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

TopLogprobs = list[tuple[int, float]]
"""``(token_id, logprob)`` pairs, most likely first."""

PromptLogprob = tuple[float, int, TopLogprobs]
"""A prompt token's logprob, its rank and the top alternatives at its position."""

PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions whose logits exist at once (``[rows, vocab]`` float32, then freed)."""


def gather_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: Sequence[int | None],
) -> tuple[list[float | None], list[int | None], list[TopLogprobs | None]]:
    """Logprob, rank and top alternatives of each row's sampled token.

    Only rows with ``num_top[r]`` not None are computed (one ``log_softmax`` over those rows).

    Args:
        logits: ``[N, V]`` float32 raw logits.
        token_ids: ``[N]`` int64 sampled tokens.
        num_top: ``N`` entries: None (no logprobs), or how many top alternatives to return.

    Returns:
        Three lists of ``N`` entries (None where not asked): the sampled token's logprob, its
        rank (1 + the number of tokens strictly more likely), and the ``num_top[r]`` most likely
        ``(token_id, logprob)`` pairs sorted by logprob descending.
    """
    n = len(num_top)
    lps: list[float | None] = [None] * n
    ranks: list[int | None] = [None] * n
    tops: list[TopLogprobs | None] = [None] * n
    rows = [r for r, k in enumerate(num_top) if k is not None]
    if not rows:
        return lps, ranks, tops
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logp = torch.log_softmax(logits[idx].float(), dim=-1)  # [R, V]
    sampled = logp.gather(1, token_ids[idx].unsqueeze(1))  # [R, 1]
    rank = (logp > sampled).sum(dim=-1) + 1
    max_k = min(max(num_top[r] for r in rows), logp.shape[1])
    top_v, top_i = logp.topk(max_k, dim=-1)  # [R, max_k]; max_k = 0 gives [R, 0]
    sampled_l, rank_l, top_vl, top_il = (
        sampled.squeeze(1).tolist(),
        rank.tolist(),
        top_v.tolist(),
        top_i.tolist(),
    )
    for j, r in enumerate(rows):
        k = num_top[r]
        lps[r] = sampled_l[j]
        ranks[r] = rank_l[j]
        tops[r] = list(zip(top_il[j][:k], top_vl[j][:k], strict=True))
    return lps, ranks, tops


def prompt_logprobs(
    hidden: torch.Tensor,
    targets: list[int],
    num_top: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    rows_per_block: int = PROMPT_LOGPROBS_ROWS,
) -> list[PromptLogprob]:
    """Logprob, rank and top alternatives of each prompt token, from the rows before it.

    Row ``i`` of ``hidden`` is the position before ``targets[i]``: its logits give the
    distribution ``targets[i]`` was drawn from (vLLM's ``prompt_logprobs``). The logits are
    made ``rows_per_block`` rows at a time, so memory stays ``rows_per_block x vocab`` floats
    whatever the prompt's length.

    Args:
        hidden: ``[R, hidden]`` final hidden states (after the norm), one per position.
        targets: ``R`` token ids, the prompt token at the position after each row.
        num_top: Top alternatives per position (``0..20``).
        compute_logits: The model's LM head, ``[r, hidden] -> [r, V]`` logits.
        rows_per_block: Rows per LM-head call.

    Returns:
        ``R`` entries ``(logprob, rank, [(token_id, logprob), ...])``: the token's raw
        logprob (``log_softmax`` of the logits, as :func:`gather_logprobs`), its rank
        (1 + the tokens strictly more likely) and the ``num_top`` most likely tokens.
    """
    out: list[PromptLogprob] = []
    if not targets:
        return out
    ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for first in range(0, len(targets), rows_per_block):
        logp = torch.log_softmax(
            compute_logits(hidden[first : first + rows_per_block]).float(), dim=-1
        )  # [r, V]
        token = logp.gather(1, ids[first : first + rows_per_block].unsqueeze(1))  # [r, 1]
        rank = (logp > token).sum(dim=-1) + 1
        top_v, top_i = logp.topk(min(num_top, logp.shape[1]), dim=-1)  # [r, k]
        for lp, rk, tv, ti in zip(
            token.squeeze(1).tolist(), rank.tolist(), top_v.tolist(), top_i.tolist(), strict=True
        ):
            out.append((lp, rk, list(zip(ti, tv, strict=True))))
        del logp
    return out


class TokenBytes:
    """Each token's exact UTF-8 bytes, for OpenAI's logprob ``bytes`` (and ``token``).

    A byte-level BPE token may hold part of a character, and a SentencePiece byte-fallback
    token (``<0xNN>``) one byte: decoding such a token alone gives U+FFFD, whose bytes are not
    the token's. The bytes here are the token's own, so they concatenate to the text.

    Args:
        tokenizer: A transformers fast tokenizer (``backend_tokenizer``) or a
            ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
        decoder = self._tok.decoder
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        self._byte_level = '"ByteLevel"' in json.dumps(state)
        self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes that ``token_id`` contributes to the text."""
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tok.id_to_token(token_id) or ""
        if self._byte_level and all(c in self._byte_decoder for c in piece):
            out = bytes(self._byte_decoder[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out = bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        else:
            out = piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker
        if len(self._cache) < 1 << 18:  # bounded: a vocabulary, not a stream of requests
            self._cache[token_id] = out
        return out

    def __call__(self, token_ids: list[int]) -> list[bytes]:
        """:meth:`token_bytes` of each id."""
        return [self.token_bytes(t) for t in token_ids]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table used by byte-level BPE vocabularies."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
