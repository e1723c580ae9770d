"""A minimal paged-KV runner for model tests: block pools, shuffled block tables, metadata.

This re-implements the step-input builder (slot mapping, positions, block tables, query start
offsets) on purpose, and independently: it is written from the attention metadata's documented
meaning, not from ``engine``'s model runner, and shares nothing with it but the
``AttentionMetadata`` type. The model tests (tests/models) thus check a model over a paged
cache with shuffled, non-contiguous block tables and NaN-filled caches against transformers
without trusting the runner; the runner's own builder is checked end to end by the engine's
parity tests (tests/engine), which compare whole generations with transformers and peft. A bug
in one builder cannot hide one in the other.

Everything a step needs (caches, slot mapping, positions, block tables, query start offsets,
sequence lengths, embeddings) is made on the model's own device, read from its parameters: the
tests load the model on the test device (``LORAPLEX_TEST_DEVICE``, tests/conftest.py) and the
harness follows it. The attention backend (what the model's layers call, not part of the
runner) is ``LORAPLEX_TEST_ATTENTION_BACKEND``: ``torch`` unless set, ``triton`` for the Triton
kernels (compiled on a GPU), as for the engine's tests.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import torch

from loraplex.engine.attention import AttentionMetadata, get_attention_backend

BACKEND = get_attention_backend(os.environ.get("LORAPLEX_TEST_ATTENTION_BACKEND") or "torch")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s weights (its first parameter's)."""
    return next(model.parameters()).device


def make_kv_caches(model, num_blocks: int, block_size: int, dtype=torch.float32):
    """One (k_cache, v_cache) per layer on the model's device, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``, NaN-filled so a read of
    an unwritten slot shows."""
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    device = model_device(model)

    def nans():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    return [(nans(), nans()) for _ in range(model.num_layers)]


def embed_tokens(model, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), hidden]`` token embeddings, on the model's device."""
    with torch.inference_mode():
        ids = torch.tensor(token_ids, dtype=torch.int64, device=model_device(model))
        return model.embed_tokens(ids)


class BlockAllocator:
    """Hands out block ids from a shuffled pool so tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        self.free = ids

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "pool exhausted"
        return taken


@dataclass
class Seq:
    """One sequence: its token ids (and optional embeddings) and its blocks."""

    token_ids: list[int]
    # [len(token_ids), hidden] on the model's device when images are spliced in
    embeds: torch.Tensor | None = None
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


def ensure_blocks(seq: Seq, upto: int, block_size: int, alloc: BlockAllocator) -> None:
    need = -(-upto // block_size)
    if need > len(seq.blocks):
        seq.blocks += alloc.take(need - len(seq.blocks))


def build_step(
    chunks: list[tuple[Seq, int]],
    block_size: int,
    alloc: BlockAllocator,
    device: torch.device | str = "cpu",
):
    """Metadata, positions and inputs for one step computing ``n`` new tokens of each seq.

    The tensors are built on the CPU, then moved to ``device`` (the model's); a sequence's
    ``embeds`` must already be there.

    Returns:
        ``(meta, positions [T] int64, input_ids [T] int64, inputs_embeds [T, hidden] or
        None)``, all on ``device``.
    """
    slots, positions, starts, seq_lens, tables = [], [], [0], [], []
    ids, embeds, any_embeds = [], [], any(s.embeds is not None for s, _ in chunks)
    for seq, n in chunks:
        start = seq.num_computed
        ensure_blocks(seq, start + n, block_size, alloc)
        for pos in range(start, start + n):
            slots.append(seq.blocks[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
        ids += seq.token_ids[start : start + n]
        if any_embeds:
            embeds.append(seq.embeds[start : start + n])
        starts.append(starts[-1] + n)
        seq_lens.append(start + n)
        tables.append(seq.blocks)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q_lens = [n for _, n in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=table.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_tokens=sum(1 for n in q_lens if n == 1),
    )
    input_ids = torch.tensor(ids, dtype=torch.int64).to(device)
    inputs_embeds = torch.cat(embeds) if any_embeds else None
    positions_t = torch.tensor(positions, dtype=torch.int64).to(device)
    return meta, positions_t, input_ids, inputs_embeds


@torch.inference_mode()
def run_step(model, kv_caches, chunks, block_size, alloc):
    """Run one step on the model's device; returns the hidden states of every token (on that
    device), split per sequence."""
    device = model_device(model)
    meta, positions, input_ids, inputs_embeds = build_step(chunks, block_size, alloc, device)
    hidden = model(
        None if inputs_embeds is not None else input_ids,
        positions,
        kv_caches,
        meta,
        BACKEND,
        inputs_embeds=inputs_embeds,
    )
    out, start = [], 0
    for seq, n in chunks:
        out.append(hidden[start : start + n])
        seq.num_computed += n
        start += n
    return out


def splice_images(model, input_ids: torch.Tensor, pixel_values: torch.Tensor | None):
    """Prompt embeddings with the image features written at the image-token rows.

    ``input_ids`` ``[T]`` and ``pixel_values`` may be on any device (the processor's are on the
    CPU); they are moved to the model's, and so is the ``[T, hidden]`` result.
    """
    device = model_device(model)
    input_ids = input_ids.to(device)
    with torch.inference_mode():
        embeds = model.embed_tokens(input_ids)
        if pixel_values is not None and len(pixel_values):
            pixel_values = pixel_values.to(device)
            features = model.encode_images(pixel_values).reshape(-1, model.hidden_size)
            mask = input_ids == model.image_token_id
            assert int(mask.sum()) == features.shape[0]
            embeds[mask] = features
    return embeds


@torch.inference_mode()
def greedy_generate(
    model,
    prompt_ids,
    pixel_values=None,
    *,
    max_new_tokens=10,
    block_size=16,
    chunk_sizes=(None,),
    eos_token_id=None,
    seed=0,
):
    """Prefill (in chunks cycling through ``chunk_sizes``), then greedy decode, on the model's
    device; returns the generated token ids (a list of ints)."""
    ids = list(prompt_ids)
    need_blocks = -(-(len(ids) + max_new_tokens) // block_size) + 2
    alloc = BlockAllocator(need_blocks * 2, seed=seed)
    kv = make_kv_caches(model, need_blocks * 2, block_size)
    embeds = None
    if getattr(model, "image_token_id", None) is not None:
        embeds = splice_images(model, torch.tensor(ids), pixel_values)
    seq = Seq(ids, embeds)
    i = 0
    hidden = None
    while seq.num_computed < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)] or len(ids)
        n = min(size, len(ids) - seq.num_computed)
        (hidden,) = run_step(model, kv, [(seq, n)], block_size, alloc)
        i += 1
    out = []
    for _ in range(max_new_tokens):
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token == eos_token_id:
            break
        seq.token_ids.append(token)
        if seq.embeds is not None:
            seq.embeds = torch.cat([seq.embeds, embed_tokens(model, [token])])
        (hidden,) = run_step(model, kv, [(seq, 1)], block_size, alloc)
    return out


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter (HF inits biases to 0 and norms to 1, hiding mapping bugs)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(module.named_parameters()):
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("bias"):
            param.copy_(0.1 * noise)
        elif param.ndim == 1 and ("norm" in name or "layrnorm" in name):
            param.copy_(1.0 + 0.1 * noise)
        elif "embed" in name or param.ndim == 1:
            param.copy_(noise)
        else:
            param.copy_(noise * param[0].numel() ** -0.5)
    return module


def top_gap(logits: torch.Tensor) -> torch.Tensor:
    """``[N, V] -> [N]`` top-1 minus top-2 logit."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def assert_same_greedy(ours: list[int], ref: list[int], ref_logits, gap_tol: float = 1e-4):
    """Tokens must match; a divergence is only excused where the reference's own top-2 logits
    are within ``gap_tol`` (a float32 near-tie). ``ref_logits(tokens)`` gives the reference's
    next-token logits ``[V]`` after ``tokens`` were generated."""
    for k, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            gap = float(top_gap(ref_logits(ref[:k])[None])[0])
            assert gap < gap_tol, f"greedy diverges at step {k}: {ours} vs {ref} (gap {gap:.2e})"
            return
    assert len(ours) == len(ref), f"{ours} vs {ref}"
