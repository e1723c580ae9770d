"""Fused projections (q/k/v, gate/up as one GEMM): the same numbers as separate projections,
with and without per-slice LoRA (a slice an adapter does not target gets nothing), and a
checkpoint that lacks one slice's tensor refused clearly at load.

The oracle is the separate ``nn.Linear`` projections, each wrapped in the per-projection
:class:`LoRALinear` (the path of ``o_proj`` and ``down_proj``), on the same slot buffers.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loraplex.engine.lora.layers import FusedLoRALinear, LoRALinear, install_lora, target_shapes
from loraplex.engine.lora.slots import SlotBuffers
from loraplex.engine.lora.torch_backend import TorchLoRABackend
from loraplex.engine.lora.triton_backend import TritonLoRABackend
from loraplex.engine.models import load_model
from loraplex.engine.models.fused import FusedLinear, LinearSlice, stacked_params

SLICES = (("q_proj", 24), ("k_proj", 8), ("v_proj", 8))
HIDDEN, MAX_RANK, MAX_LORAS = 16, 8, 3
# Slot 0 targets q and v only (rank 0 on k), slot 1 all three with different ranks, slot 2
# nothing of this layer.
RANKS = {"q_proj": [4, 8, 0], "k_proj": [0, 2, 0], "v_proj": [6, 8, 0]}


def _separate(gen: torch.Generator, bias: bool) -> list[nn.Linear]:
    linears = []
    for _, out in SLICES:
        lin = nn.Linear(HIDDEN, out, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out, HIDDEN, generator=gen))
            if bias:
                lin.bias.copy_(torch.randn(out, generator=gen))
        linears.append(lin)
    return linears


def _fused_from(linears: list[nn.Linear], bias: bool) -> FusedLinear:
    fused = FusedLinear(HIDDEN, SLICES, bias=bias)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if bias:
            fused.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return fused


def _buffers(gen: torch.Generator, device: torch.device) -> dict[str, SlotBuffers]:
    out = {}
    for name, width in SLICES:
        ranks = RANKS[name]
        a = torch.zeros(MAX_LORAS, MAX_RANK, HIDDEN)
        b = torch.zeros(MAX_LORAS, width, MAX_RANK)
        scales = torch.zeros(MAX_LORAS)
        for s, r in enumerate(ranks):
            if r:
                a[s, :r] = torch.randn(r, HIDDEN, generator=gen)
                b[s, :, :r] = torch.randn(width, r, generator=gen)
                scales[s] = 0.5 + s
        out[name] = SlotBuffers.of(a.to(device), b.to(device), scales.to(device), ranks)
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_equals_the_separate_projections(bias):
    gen = torch.Generator().manual_seed(1)
    linears = _separate(gen, bias)
    fused = _fused_from(linears, bias)
    x = torch.randn(7, HIDDEN, generator=gen)
    parts = fused.split(fused(x))
    assert [p.shape[1] for p in parts] == [out for _, out in SLICES]
    for part, lin in zip(parts, linears, strict=True):
        torch.testing.assert_close(part, lin(x), atol=1e-5, rtol=1e-5)
    pieces = fused.slices()
    assert [(p.name, p.offset, p.out_features, p.in_features) for p in pieces] == [
        ("q_proj", 0, 24, HIDDEN), ("k_proj", 24, 8, HIDDEN), ("v_proj", 32, 8, HIDDEN)
    ]  # fmt: skip
    assert torch.equal(pieces[1].weight, linears[1].weight)
    assert (pieces[2].bias is None) == (not bias)
    with pytest.raises(ValueError, match="bad fused slices"):
        FusedLinear(HIDDEN, (("q_proj", 4), ("q_proj", 4)))


def _backends(device: torch.device):
    yield "torch-contiguous-or-segments", TorchLoRABackend(batched=False)
    yield "torch-batched", TorchLoRABackend(batched=True)
    yield "triton", TritonLoRABackend()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["grouped", "scattered"])
def test_per_slice_lora_is_exact_and_skips_untargeted_slices(test_device, layout, bias):
    gen = torch.Generator().manual_seed(2)
    dev = test_device
    linears = [lin.to(dev) for lin in _separate(gen, bias)]
    fused_base = _fused_from(linears, bias).to(dev)
    buffers = _buffers(gen, dev)
    tokens = 17
    slots = torch.randint(-1, MAX_LORAS, (tokens,), generator=gen).tolist()
    slots[:4] = [0, 1, 2, -1]  # every slot present
    if layout == "grouped":
        slots = sorted(slots)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dev)
    atol = 1e-5 if dev.type == "cpu" else 1e-4
    for label, backend in _backends(dev):
        fused = FusedLoRALinear(fused_base, [buffers[n] for n, _ in SLICES], backend)
        pairs = zip(linears, SLICES, strict=True)
        separate = [LoRALinear(lin, buffers[n], backend) for lin, (n, _) in pairs]
        backend.update_metadata(slots, dev)
        assert backend.active
        with torch.no_grad():
            got = fused.split(fused(x))
            want = [m(x) for m in separate]
            base = [lin(x) for lin in linears]
        for (name, _), g, w, b in zip(SLICES, got, want, base, strict=True):
            torch.testing.assert_close(g, w, atol=atol, rtol=1e-5, msg=f"{label} {name}")
            for i, s in enumerate(slots):  # nothing where the slot does not target the slice
                if s < 0 or RANKS[name][s] == 0:
                    torch.testing.assert_close(g[i], b[i], atol=atol, rtol=1e-5)
                else:
                    assert not torch.allclose(g[i], b[i], atol=1e-3), (label, name, i)
        backend.clear()
        with torch.no_grad():
            torch.testing.assert_close(fused(x), fused_base(x), atol=0, rtol=0)


def test_install_lora_wraps_a_fused_module_once_with_each_slice(text_dir):
    model, _ = load_model(text_dir, torch.float32, "cpu")
    names = [(i, n) for i, n, _ in model.lora_targets()]
    assert names[:7] == [
        (0, "q_proj"), (0, "k_proj"), (0, "v_proj"), (0, "o_proj"),
        (0, "gate_proj"), (0, "up_proj"), (0, "down_proj"),
    ]  # fmt: skip
    shapes = target_shapes(model)
    attn = model.model.layers[0].self_attn
    assert shapes[(0, "k_proj")] == (model.hidden_size, model.num_kv_heads * model.head_dim)
    buffers = {
        key: SlotBuffers(2, 4, i, o, torch.device("cpu"), torch.float32)
        for key, (i, o) in shapes.items()
    }
    assert install_lora(model, buffers, TorchLoRABackend()) == len(shapes)
    assert isinstance(attn.qkv_proj, FusedLoRALinear)
    assert attn.qkv_proj.buffers[1] is buffers[(0, "k_proj")]
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, FusedLoRALinear)
    assert isinstance(attn.o_proj, LoRALinear)
    # After install the targets are the same (the slices of the wrapped fused modules).
    assert target_shapes(model) == shapes
    unfused = ("o_proj", "down_proj")
    assert all(isinstance(t, LinearSlice) for _, n, t in model.lora_targets() if n not in unfused)


def test_the_loader_fills_each_slice_and_refuses_a_missing_or_misshaped_one(tmp_path, text_dir):
    model, _ = load_model(text_dir, torch.float32, "cpu")
    tensors = load_file(text_dir / "model.safetensors")
    stacked = stacked_params(model)
    assert stacked["model.layers.1.mlp.gate_up_proj.weight"][1][0] == (
        "model.layers.1.mlp.up_proj.weight"
    )
    state = model.state_dict()
    for fused, parts in stacked.items():
        want = torch.cat([tensors[name] for name, _, _ in parts])
        assert torch.equal(state[fused], want), fused

    d = tmp_path / "missing"
    shutil.copytree(text_dir, d)
    cut = {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    save_file(cut, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.0\.self_attn\.k_proj\.weight"
    ):
        load_model(d, torch.float32, "cpu")

    d = tmp_path / "shape"
    shutil.copytree(text_dir, d)
    bad = dict(tensors)
    v = bad["model.layers.0.self_attn.v_proj.weight"]
    bad["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(v.shape[0] + 1, v.shape[1])
    save_file(bad, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.v_proj\.weight' has shape .* \(rows \d+:\d+ of "
        r"'model\.layers\.0\.self_attn\.qkv_proj\.weight'\)",
    ):
        load_model(d, torch.float32, "cpu")
