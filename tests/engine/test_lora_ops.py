"""The LoRA backends: every layout of the torch backend against a per-token loop (Punica
semantics), the Triton backend against the torch one.

The backends run on the ``test_device`` (tests/conftest.py; Triton's interpreter on CPU);
inputs are drawn and the per-token oracle computed on the CPU.
"""

import subprocess
import sys

import pytest
import torch

from loraplex.engine.lora.backend import LoRABackend, select_lora_backend
from loraplex.engine.lora.slots import SlotBuffers
from loraplex.engine.lora.torch_backend import TorchLoRABackend
from loraplex.engine.lora.triton_backend import TritonLoRABackend


@pytest.mark.parametrize("layout", ["scattered", "grouped"])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical"])
@pytest.mark.parametrize("num_slots", [1, 2, 5])
def test_add_lora_matches_a_per_token_loop(test_device, popularity, num_slots, layout):
    gen = torch.Generator().manual_seed(num_slots)
    tokens, fan_in, fan_out, max_rank, max_loras = 23, 12, 10, 8, 6
    ranks = [8, 4, 2, 6, 8, 1][:max_loras]
    a = torch.zeros(max_loras, max_rank, fan_in)
    b = torch.zeros(max_loras, fan_out, max_rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, fan_in, generator=gen)
        b[s, :, :r] = torch.randn(fan_out, r, generator=gen)
    scales = torch.rand(max_loras, generator=gen) + 0.5
    dev = test_device
    buffers = SlotBuffers.of(a.to(dev), b.to(dev), scales.to(dev), ranks)
    pool = list(range(num_slots))
    if popularity == "distinct":
        slots = [pool[i % num_slots] for i in range(tokens)]
    elif popularity == "uniform":
        slots = torch.randint(0, num_slots, (tokens,), generator=gen).tolist()
    elif popularity == "zipf":
        w = torch.tensor([1 / (k + 1) ** 1.2 for k in range(num_slots)])
        slots = torch.multinomial(w, tokens, replacement=True, generator=gen).tolist()
    else:
        slots = [0] * tokens
    slots = [s if i % 5 else -1 for i, s in enumerate(slots)]  # base-model tokens mixed in
    if layout == "grouped":  # as the scheduler orders a step: one run per slot, base first
        slots = sorted(slots)
    x = torch.randn(tokens, fan_in, generator=gen)
    y0 = torch.randn(tokens, fan_out, generator=gen)
    expected = y0.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            r = ranks[s]
            expected[i] += scales[s] * (x[i] @ a[s, :r].T) @ b[s, :, :r].T
    # Float32 throughout; on a GPU cuBLAS sums in another order than the CPU loop (never TF32:
    # torch's float32 matmuls default to full precision), so a little more absolute slack there.
    atol = 1e-5 if dev.type == "cpu" else 1e-4
    for batched in (False, True, None):
        ctx = TorchLoRABackend(batched=batched)
        ctx.update_metadata(slots, dev)
        runs = [s for i, s in enumerate(slots) if s >= 0 and (i == 0 or slots[i - 1] != s)]
        assert ctx.contiguous == (len(runs) == len(set(runs)))
        if layout == "grouped":
            assert ctx.contiguous and ctx.perm is None
        if batched is not None and not ctx.contiguous:
            assert (ctx.slot_ids is not None) == batched
        assert ctx.active
        out = ctx.apply(y0.clone().to(dev), x.to(dev), buffers)
        assert out.device == dev
        torch.testing.assert_close(out.cpu(), expected, atol=atol, rtol=1e-5)
        ctx.clear()
        assert not ctx.active and ctx.segments == [] and ctx.slot_ids is None


@pytest.mark.parametrize("layout", ["scattered", "grouped"])
def test_the_triton_backend_equals_the_torch_backend(test_device, layout):
    """The two implementations of ``engine.lora.backend`` on the same step (float32: the
    Triton kernels' dots are exact float32, ``input_precision="ieee"``)."""
    gen = torch.Generator().manual_seed(11)
    tokens, fan_in, fan_out, max_rank, max_loras = 19, 16, 24, 8, 4
    ranks = [8, 0, 4, 2]
    a = torch.zeros(max_loras, max_rank, fan_in)
    b = torch.zeros(max_loras, fan_out, max_rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, fan_in, generator=gen)
        b[s, :, :r] = torch.randn(fan_out, r, generator=gen)
    dev = test_device
    scales = torch.rand(max_loras, generator=gen) + 0.5
    buffers = SlotBuffers.of(a.to(dev), b.to(dev), scales.to(dev), ranks)
    slots = torch.randint(-1, max_loras, (tokens,), generator=gen).tolist()
    if layout == "grouped":
        slots = sorted(slots)
    x = torch.randn(tokens, fan_in, generator=gen)
    y0 = torch.randn(tokens, fan_out, generator=gen)
    out = {}
    for backend in (TorchLoRABackend(), TritonLoRABackend()):
        backend.update_metadata(slots, dev)  # each prepares its own metadata
        assert backend.active
        out[backend.name] = backend.apply(y0.clone().to(dev), x.to(dev), buffers).cpu()
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)
    assert not torch.equal(out["torch"], y0)  # the adapters did something


def test_the_backend_is_chosen_by_the_attention_backend():
    assert select_lora_backend("torch").name == "torch"
    assert select_lora_backend("triton").name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_lora_backend("cuda")


def test_each_backend_is_a_lora_backend():
    for name in ("torch", "triton"):
        assert isinstance(select_lora_backend(name), LoRABackend)


LORA_MODULES = ["backend", "layers", "slots", "torch_backend", "triton_backend"]


@pytest.mark.slow  # a fresh interpreter each (about a second)
@pytest.mark.parametrize("module", LORA_MODULES)
def test_each_lora_module_imports_alone(module):
    # engine/lora/ has no import cycle: any of its modules is importable first.
    code = f"import loraplex.engine.lora.{module}"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
