"""oneDNN-prepacked linears (``engine.models.packed_linear``) against ``F.linear``, and an engine
with them against one without (the LoRA and transformers parity suites run with them on: it is
the CPU default)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.models import packed_linear
from loraplex.engine.models.packed_linear import PackedLinear, can_pack, pack_linears
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 130])
def test_matches_f_linear(dtype, tol, bias, rows):
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    packed = PackedLinear(lin)
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    got = packed(x)
    assert got.dtype == dtype and got.shape == (rows, 160)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)
    # Leading dimensions are kept (a transformers-style [1, T, in] input).
    torch.testing.assert_close(packed(x[None])[0], got)
    assert torch.equal(packed.weight, lin.weight.detach())  # unpacks to the dense weight


def test_non_contiguous_input():
    lin = nn.Linear(32, 48)
    x = torch.randn(10, 64)[:, ::2]  # [10, 32], stride 2
    torch.testing.assert_close(PackedLinear(lin)(x), lin(x), rtol=1e-5, atol=1e-5)


def test_refusals():
    assert can_pack(torch.device("cpu"), torch.float32) is None
    assert "float16" in can_pack(torch.device("cpu"), torch.float16)
    assert "CPU" in can_pack(torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="float16"):
        PackedLinear(nn.Linear(4, 4).half())
    with pytest.raises(RuntimeError, match="input dtype"):
        PackedLinear(nn.Linear(4, 4))(torch.zeros(2, 4, dtype=torch.bfloat16))


def test_pack_linears_replaces_every_linear_and_registry_is_weak(monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_PACK_ELEMENTS", 0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    x = torch.randn(5, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert all(type(m) is not nn.Linear for m in model.modules())
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    keys = [m.key for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(k in packed_linear._REGISTRY for k in keys)
    del model
    gc.collect()
    assert not any(k in packed_linear._REGISTRY for k in keys)  # no layer kept alive


def _tokens(model_dir, **kw):
    llm = LLM(EngineConfig(model=model_dir, max_num_batched_tokens=32, **kw))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11] * (i + 1) for i in range(5)]
    outs = llm.generate([EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return llm, [o.outputs[0].token_ids for o in outs]


def test_small_linears_stay_dense():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(256, 256))
    assert pack_linears(model) == 1  # 4,096 elements: oneDNN's call costs more than the GEMM
    assert type(model[0]) is nn.Linear and isinstance(model[1], PackedLinear)


@pytest.mark.slow  # two engines
def test_engine_prepacks_by_default_and_generates_the_same_tokens(tiny_text_dir, monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_PACK_ELEMENTS", 0)  # the tiny model's are small
    packed_llm, packed = _tokens(tiny_text_dir)
    dense_llm, dense = _tokens(tiny_text_dir, cpu_prepack_weights=False)
    assert packed == dense
    lm = packed_llm.engine.model
    assert any(isinstance(m, PackedLinear) for m in lm.modules())
    assert not any(isinstance(m, PackedLinear) for m in dense_llm.engine.model.modules())
