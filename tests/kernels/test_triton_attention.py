"""Triton paged attention and reshape_and_cache against the float32 torch references.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``); with ``LORAPLEX_TEST_DEVICE=cuda`` they run compiled on the GPU, and a
few larger shapes (head_dim 128, GQA 32/8, batch 64, contexts over many split-KV partitions)
run too. Inputs are drawn on the CPU (the same numbers on either device) and the reference is
computed there in float32; the kernel's output comes back to be compared. Block tables hold
shuffled, non-contiguous blocks; caches start as NaN so a read past the context shows; outputs
start as NaN so an unwritten element fails.

Tolerances: float32 inputs go through ``tl.dot(..., input_precision="ieee")`` (exact float32
products, not TF32) on the GPU and in the interpreter alike, so float32 keeps its tight bound;
float16/bfloat16 use the tensor cores on the GPU (the softmax weights rounded to the input dtype
before ``P @ V``, float32 accumulation), well inside the bounds, which are set by the output's
own rounding (docs/kernels.md).
"""

import random

import pytest
import torch

from loraplex.kernels.paged_attention_ref import paged_attention_ref, reshape_and_cache_ref
from loraplex.kernels.triton_attention import paged_attention
from loraplex.kernels.triton_cache import reshape_and_cache
from loraplex.kernels.triton_split_kv import merge_splits, merge_splits_ref
from tests.support import cuda_only

# (atol, rtol) of the kernel's output (rounded to its dtype) against the float32 reference.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def make_problem(seqs, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Caches holding each sequence's context, behind shuffled block tables.

    ``seqs``: (cached context, new queries) per sequence. Returns the kernel's arguments.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(blocks_needed), dtype=torch.int32)
    slots = []
    for b, ((ctx, new), nb) in enumerate(zip(seqs, blocks_needed, strict=True)):
        ids = [free.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(ids)
        pos = torch.arange(ctx + new)
        slots.append(torch.tensor(ids)[pos // block_size] * block_size + pos % block_size)
    all_slots = torch.cat(slots)
    keys = torch.randn(len(all_slots), kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(len(all_slots), kv_heads, head_dim, generator=gen).to(dtype)
    reshape_and_cache_ref(keys, values, k_cache, v_cache, all_slots)
    num_q = sum(n for _, n in seqs)
    query = torch.randn(num_q, heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    return query, k_cache, v_cache, tables, seq_lens, qsl


def check(
    device, seqs, heads, kv_heads, head_dim, block_size, dtype, window=None, splits=1, seed=0
):
    """The kernel on ``device`` against the float32 reference on the CPU (``splits``: None
    lets the kernel choose, as the engine does)."""
    problem = make_problem(seqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    query, k_cache, v_cache, tables, seq_lens, qsl = problem
    kw = dict(
        max_query_len=max(n for _, n in seqs),
        max_seq_len=int(seq_lens.max()),
        sliding_window=window,
    )
    scale = head_dim**-0.5
    ref = paged_attention_ref(
        query.float(), k_cache.float(), v_cache.float(), tables, seq_lens, qsl, scale, **kw
    )
    args = [t.to(device) for t in problem]
    out = torch.full_like(args[0], float("nan"))
    got = paged_attention(*args, scale, num_splits=splits, out=out, **kw)
    assert got is out and got.dtype == dtype and got.device == device
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), ref, atol=atol, rtol=rtol)


# (cached context, new queries): decode, fresh prefill, prefill over a cached prefix of whole
# blocks, chunk over a ragged prefix, a first decode, a long decode.
MIXED = [(9, 1), (0, 13), (32, 5), (21, 7), (0, 1), (75, 1)]


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size, dtype, window",
    [
        (4, 2, 64, 16, torch.float32, None),
        (6, 2, 80, 32, torch.bfloat16, None),  # group of 3: padded GQA rows
        (4, 1, 96, 16, torch.float16, 24),
        (8, 4, 128, 32, torch.float32, 40),
        (2, 1, 64, 16, torch.bfloat16, 6),
    ],
)
def test_mixed_batch_matches_reference(
    test_device, heads, kv_heads, head_dim, block_size, dtype, window
):
    check(test_device, MIXED, heads, kv_heads, head_dim, block_size, dtype, window)


@pytest.mark.parametrize(
    "splits, window, dtype",
    [(2, None, torch.float32), (4, None, torch.float16), (4, 20, torch.bfloat16)],
)
def test_split_kv_decode_matches_reference(test_device, splits, window, dtype):
    # Splits of a short context are empty: their partials must weigh nothing.
    seqs = [(150, 1), (3, 1), (64, 1), (97, 1)]
    check(test_device, seqs, 4, 2, 64, 16, dtype, window, splits=splits, seed=splits)


def test_split_kv_also_covers_prefill_rows(test_device):
    check(test_device, [(40, 6), (0, 3)], 4, 2, 64, 16, torch.float32, None, splits=2, seed=3)


def test_random_shapes(test_device):
    rng = random.Random(1234)
    for case in range(3):
        kv_heads = rng.choice([1, 2])
        heads = kv_heads * rng.choice([1, 2, 4])
        block_size = rng.choice([16, 32])
        seqs = [
            (rng.choice([0, rng.randrange(1, 90)]), rng.choice([1, 1, rng.randrange(2, 12)]))
            for _ in range(rng.randrange(2, 6))
        ]
        check(
            test_device,
            seqs,
            heads,
            kv_heads,
            rng.choice([64, 80, 96, 128]),
            block_size,
            rng.choice(list(TOL)),
            rng.choice([None, rng.randrange(4, 64)]),
            seed=case,
        )


# Compiled on the GPU only: the interpreter would take minutes over these contexts.
LARGE = "production shapes, minutes under the Triton interpreter"


@cuda_only(LARGE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_large_decode_batch(test_device, dtype):
    # Batch 64 of decodes over contexts of 200-4,000 positions, GQA 32/8, head_dim 128, with
    # the split-KV count the kernel picks for the device (num_kv_splits), as the engine runs it.
    gen = torch.Generator().manual_seed(64)
    seqs = [(int(c), 1) for c in torch.randint(200, 4000, (64,), generator=gen)]
    check(test_device, seqs, 32, 8, 128, 16, dtype, splits=None, seed=64)


@cuda_only(LARGE)
@pytest.mark.parametrize(
    "dtype, window", [(torch.bfloat16, None), (torch.float16, 1000), (torch.float32, None)]
)
def test_long_context_decode_splits_kv(test_device, dtype, window):
    # Two long decodes leave most SMs idle: the kernel splits the KV into many partitions
    # (its own choice, then 16 explicitly), merged by merge_splits.
    from loraplex.kernels.triton_split_kv import num_kv_splits

    seqs = [(8191, 1), (3000, 1)]
    assert num_kv_splits(2 * 8, 1, 8192, 64, test_device) > 2  # sequences x KV heads

    check(test_device, seqs, 32, 8, 128, 16, dtype, window, splits=None, seed=7)
    check(test_device, seqs, 32, 8, 128, 32, dtype, window, splits=16, seed=8)


@cuda_only(LARGE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_prefill_over_a_cached_prefix_with_decodes(test_device, dtype):
    # A 1,000-token chunk over a 1,500-token cached prefix, a fresh 700-token prefill, and
    # decodes beside them; GQA 8/1 and head_dim 64, then 32/8 and head_dim 128 with a window.
    seqs = [(1500, 1000), (0, 700)] + [(c, 1) for c in (5, 300, 2047, 999)]
    check(test_device, seqs, 8, 1, 64, 16, dtype, seed=11)
    check(test_device, seqs, 32, 8, 128, 16, dtype, window=512, seed=12)


def test_merge_splits_matches_reference(test_device):
    gen = torch.Generator().manual_seed(0)
    partial = torch.randn(3, 4, 2, 80, generator=gen)
    lse = torch.randn(3, 4, 2, generator=gen) * 4
    lse[0, 1:] = float("-inf")  # empty splits
    out = torch.full((3, 2, 80), float("nan"), device=test_device)
    merge_splits(partial.to(test_device), lse.to(test_device), out)
    out = out.cpu()
    torch.testing.assert_close(out, merge_splits_ref(partial, lse), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], partial[0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_matches_reference(test_device, dtype):
    gen = torch.Generator().manual_seed(5)
    tokens, kv_heads, head_dim, block_size = 21, 3, 80, 16
    shape = (8, block_size, kv_heads, head_dim)
    slots = torch.randperm(8 * block_size, generator=gen)[:tokens]
    slots[[4, 11]] = -1  # padding tokens: skipped
    # Keys and values as strided views of one fused projection, like the model's.
    qkv = torch.randn(tokens, 4 * kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim : 3 * kv_heads * head_dim].view(
        tokens, kv_heads, head_dim
    )
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    reshape_and_cache_ref(key[keep], value[keep], k_ref, v_ref, slots[keep])
    on = [t.to(test_device) for t in (qkv, k_cache, v_cache, slots)]
    width = kv_heads * head_dim
    key, value = (
        on[0][:, i * width : (i + 1) * width].view(tokens, kv_heads, head_dim) for i in (1, 2)
    )
    reshape_and_cache(key, value, on[1], on[2], on[3])
    k_cache, v_cache = on[1].cpu(), on[2].cpu()
    assert torch.equal(k_cache.nan_to_num(123.0), k_ref.nan_to_num(123.0))
    assert torch.equal(v_cache.nan_to_num(123.0), v_ref.nan_to_num(123.0))
    assert int(k_cache.isnan().any(dim=(2, 3)).sum()) == 8 * block_size - (tokens - 2)
