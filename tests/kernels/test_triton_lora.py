"""Triton LoRA shrink/expand against the float32 torch references (Punica semantics).

Adapter popularity distinct / uniform / zipf / identical, base-model tokens (slot -1) mixed in,
mixed ranks per slot and per slice, fused slices of different widths. The shrink's output
starts as NaN, so an adapter row it fails to write fails; base rows must stay NaN.

The kernels run on the ``test_device`` (the interpreter on CPU, compiled with
``LORAPLEX_TEST_DEVICE=cuda``, where a few production-sized shapes run too); inputs are drawn
and the references computed on the CPU. float32 is exact on both (``input_precision="ieee"``);
on the GPU float16/bfloat16 run on the tensor cores and the expand rounds ``h`` to the weights'
dtype first, inside the bounds below (docs/kernels.md).
"""

import random

import pytest
import torch

from loraplex.kernels.lora_ops import lora_expand, lora_shrink, make_lora_batch
from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from tests.support import cuda_only

# (atol, rtol) of the shrink's float32 h, and of the expand's y in its dtype.
H_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
Y_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def token_slots(popularity, tokens, num_slots, gen):
    """Slot of each token for a popularity pattern; every 4th token is a base-model one."""
    if popularity == "distinct":
        slots = [i % num_slots for i in range(tokens)]
    elif popularity == "uniform":
        slots = torch.randint(0, num_slots, (tokens,), generator=gen).tolist()
    elif popularity == "zipf":
        w = torch.tensor([1 / (k + 1) ** 1.2 for k in range(num_slots)])
        slots = torch.multinomial(w, tokens, replacement=True, generator=gen).tolist()
    else:
        slots = [num_slots - 1] * tokens
    return [s if i % 4 != 1 else -1 for i, s in enumerate(slots)]


def make_stacks(num_loras, max_rank, fan_in, widths, dtype, gen):
    """Per slice: A ``[L, R, in]``, B ``[L, out, R]`` zero-padded past each slot's rank, scales,
    ranks (slot 0 of the last slice does not target it: rank 0, scale 0)."""
    a_list, b_list, scales, ranks = [], [], [], []
    for k, width in enumerate(widths):
        r = torch.randint(1, max_rank + 1, (num_loras,), generator=gen)
        r[k % num_loras] = max_rank
        if k == len(widths) - 1 and num_loras > 1:
            r[0] = 0
        a = torch.zeros(num_loras, max_rank, fan_in)
        b = torch.zeros(num_loras, width, max_rank)
        for s, rank in enumerate(r.tolist()):
            a[s, :rank] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b[s, :, :rank] = torch.randn(width, rank, generator=gen) / max(rank, 1) ** 0.5
        scale = torch.rand(num_loras, generator=gen) + 0.5
        scale[r == 0] = 0.0
        a_list.append(a.to(dtype))
        b_list.append(b.to(dtype))
        scales.append(scale)
        ranks.append(r.to(torch.int32))
    return a_list, b_list, scales, ranks


def check(device, slots, fan_in, widths, max_rank, num_loras, dtype, seed, offsets=None, split_k=1):
    """Shrink and expand on ``device`` against the references on the CPU (``split_k``: None
    lets the shrink choose, as the engine does); returns the CPU ``(y0, y)``."""
    gen = torch.Generator().manual_seed(seed)
    a, b, scales, ranks = make_stacks(num_loras, max_rank, fan_in, widths, dtype, gen)
    x = torch.randn(len(slots), fan_in, generator=gen).to(dtype)
    slot_of = torch.tensor(slots, dtype=torch.long)
    adapter = slot_of >= 0

    def on(tensors):
        return [t.to(device) for t in tensors]

    batch = make_lora_batch(slots, device)
    h_ref = lora_shrink_ref(x, a, slot_of, ranks)
    poisoned = torch.full((len(widths), len(slots), max_rank), float("nan"), device=device)
    h = lora_shrink(x.to(device), on(a), batch, on(ranks), split_k=split_k, out=poisoned)
    assert h is poisoned
    h = h.cpu()
    atol, rtol = H_TOL[dtype]
    torch.testing.assert_close(h[:, adapter], h_ref[:, adapter], atol=atol, rtol=rtol)
    if split_k == 1:
        assert h[:, ~adapter].isnan().all()  # base-model rows are never written

    total = (max(offsets) + widths[-1] + 3) if offsets else sum(widths)
    y0 = torch.randn(len(slots), total, generator=gen).to(dtype)
    y_ref = lora_expand_ref(y0.clone(), h_ref, b, scales, slot_of, ranks, offsets)
    y = lora_expand(
        y0.clone().to(device), h.to(device), on(b), on(scales), batch, on(ranks), offsets
    )
    y = y.cpu()
    atol, rtol = Y_TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=rtol)
    assert torch.equal(y[~adapter], y0[~adapter])
    return y0, y


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qkv_slices_by_popularity(test_device, popularity, dtype):
    gen = torch.Generator().manual_seed(3)
    slots = token_slots(popularity, 41, 5, gen)
    check(
        test_device,
        slots,
        fan_in=96,
        widths=[80, 32, 32],
        max_rank=16,
        num_loras=6,
        dtype=dtype,
        seed=1,
    )


@pytest.mark.parametrize("popularity", ["distinct", "zipf"])
def test_single_projection_float16(test_device, popularity):
    gen = torch.Generator().manual_seed(4)
    slots = token_slots(popularity, 30, 3, gen)
    check(
        test_device,
        slots,
        fan_in=200,
        widths=[176],
        max_rank=8,
        num_loras=4,
        dtype=torch.float16,
        seed=2,
    )


def test_expand_writes_only_its_column_slices(test_device):
    slots = token_slots("uniform", 19, 3, torch.Generator().manual_seed(5))
    y0, y = check(test_device, slots, 64, [48, 24], 16, 3, torch.float32, seed=3, offsets=[10, 70])
    for lo, hi in [(0, 10), (58, 70), (94, y.shape[1])]:  # gaps between and around slices
        assert torch.equal(y[:, lo:hi], y0[:, lo:hi])


def test_split_k_shrink(test_device):
    slots = token_slots("zipf", 12, 2, torch.Generator().manual_seed(6))
    check(test_device, slots, 300, [64], 32, 2, torch.float32, seed=4, split_k=3)


def test_no_adapter_tokens_is_a_no_op(test_device):
    batch = make_lora_batch([-1, -1, -1], test_device)
    assert batch.num_blocks == 0 and batch.slots == ()
    a = torch.randn(2, 8, 16, device=test_device)
    h = lora_shrink(torch.randn(3, 16, device=test_device), a, batch)
    y = torch.randn(3, 12, device=test_device)
    b = torch.randn(2, 12, 8, device=test_device)
    out = lora_expand(y.clone(), h, b, torch.ones(2, device=test_device), batch)
    assert torch.equal(out, y)


def test_batch_blocks_cover_each_adapter_token_once():
    slots = [2, -1, 0, 2, 2, -1, 1] + [0] * 20
    batch = make_lora_batch(slots, "cpu", block_m=16)
    assert batch.slots == (0, 1, 2)
    seen = []
    for slot, start, end in batch.blocks.tolist():
        rows = batch.sorted_tokens[start : min(start + 16, end)].tolist()
        assert all(slots[t] == slot for t in rows)
        seen += rows
    assert sorted(seen) == [i for i, s in enumerate(slots) if s >= 0]
    assert batch.blocks[:, 0].tolist() == [0, 0, 1, 2]  # slot 0's 21 tokens: two blocks


def test_random_shapes(test_device):
    rng = random.Random(99)
    for case in range(3):
        num_loras = rng.randrange(1, 7)
        popularity = rng.choice(["distinct", "uniform", "zipf", "identical"])
        slots = token_slots(popularity, rng.randrange(1, 50), num_loras, torch.Generator())
        widths = [rng.randrange(8, 150) for _ in range(rng.choice([1, 2, 3]))]
        check(
            test_device,
            slots,
            rng.randrange(16, 160),
            widths,
            rng.choice([8, 16, 32, 64]),
            num_loras,
            rng.choice(list(H_TOL)),
            seed=case,
        )


LARGE = "production shapes, minutes under the Triton interpreter"


@cuda_only(LARGE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("popularity", ["distinct", "zipf"])
def test_large_decode_batch_fused_qkv(test_device, dtype, popularity):
    # Batch 64 of decodes over 16 adapters (rank 16 buffers, mixed ranks), a 4096-wide model's
    # fused q/k/v (GQA 32/8 of head_dim 128): BLOCK_M 16, MULTI slices, the shrink's split-K
    # its own choice (shrink_split_k) as in the engine.
    slots = token_slots(popularity, 64, 16, torch.Generator().manual_seed(21))
    check(test_device, slots, 4096, [4096, 1024, 1024], 16, 16, dtype, seed=21, split_k=None)


@cuda_only(LARGE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_prefill_gate_up_and_split_k(test_device, dtype):
    # 600 prefill tokens of 4 adapters (BLOCK_M 64) through gate/up (4096 -> 2 x 11008) at
    # rank 64, then a down projection's shrink split 4 ways over its 11008 inputs.
    slots = token_slots("uniform", 600, 4, torch.Generator().manual_seed(22))
    check(test_device, slots, 4096, [11008, 11008], 64, 4, dtype, seed=22, split_k=None)
    decode = token_slots("distinct", 8, 4, torch.Generator().manual_seed(23))
    check(test_device, decode, 11008, [4096], 64, 4, dtype, seed=23, split_k=4)
