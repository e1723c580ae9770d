"""The KV pool's size: the pure rule (fixed numbers, properties), the machine, the engine."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv_cache import profile as kv_profile
from loraplex.engine.kv_cache.sizing import GiB, MemoryFigures, MiB, parse_size, size_kv_pool

# One block of SmolLM-135M's shape: 30 layers x 16 tokens x 3 KV heads x 64 x K,V x 4 bytes.
SMOL_BLOCK = 2 * 30 * 16 * 3 * 64 * 4


def cpu(available, **kw):
    args = {"block_bytes": SMOL_BLOCK, "block_size": 16, "device": "cpu", "max_model_len": 2048}
    args.update(max_num_seqs=64, memory=MemoryFigures(available_bytes=available))
    return size_kv_pool(**(args | kw))


def cuda(total, weights, activation, free=None, **kw):
    memory = MemoryFigures(
        total, weights_bytes=weights, activation_bytes=activation, free_bytes=free
    )
    args = {"block_bytes": SMOL_BLOCK, "block_size": 16, "device": "cuda", "max_model_len": 2048}
    return size_kv_pool(**(args | {"max_num_seqs": 64, "memory": memory} | kw))


# ------------------------------------------------------------------------ fixed numbers
def test_cpu_takes_half_of_available_memory():
    s = cpu(8 * GiB)
    assert s.rule == "cpu_kv_cache_share" and s.share == 0.5
    assert s.num_blocks == (4 * GiB) // SMOL_BLOCK == 5825
    assert s.cap_blocks is None
    assert "--cpu-kv-cache-share 0.5 of 8.00 GiB RAM available" in s.describe()
    assert s.describe().startswith("KV pool of 5825 blocks (16 tokens each, 93200 tokens) = 4.00")


def test_cpu_share_flag():
    assert cpu(8 * GiB, cpu_kv_cache_share=0.25).num_blocks == (2 * GiB) // SMOL_BLOCK


def test_cpu_pool_is_capped_at_what_the_batch_can_hold():
    # 64 sequences of 2048 tokens = 64 * 128 blocks; a 1 TiB host does not get a 512 GiB pool.
    s = cpu(1024 * GiB)
    assert s.num_blocks == s.cap_blocks == 64 * 128
    assert s.budget_bytes == 512 * GiB
    assert "capped at max-num-seqs x max-model-len" in s.describe()
    # The cap rounds a partial block up: 64 sequences of 2050 tokens need 129 blocks each.
    assert cpu(1024 * GiB, max_model_len=2050).num_blocks == 64 * 129


def test_cuda_subtracts_weights_and_activations_from_the_utilization_budget():
    # 80 GiB device, 0.9 of it = 72 GiB; 16 GiB weights and 4 GiB activations leave 52 GiB.
    s = cuda(80 * GiB, 16 * GiB, 4 * GiB, free=60 * GiB)
    assert s.rule == "gpu_memory_utilization" and s.budget_bytes == int(0.9 * 80 * GiB) - 20 * GiB
    assert s.num_blocks == s.budget_bytes // SMOL_BLOCK
    assert s.cap_blocks is None  # no cap on a device the server has to itself
    assert "--gpu-memory-utilization 0.9 of 80.00 GiB device memory" in s.describe()
    assert cuda(80 * GiB, 16 * GiB, 4 * GiB, gpu_memory_utilization=0.5).budget_bytes == 20 * GiB


def test_cuda_takes_no_more_than_is_free_when_another_process_holds_memory():
    # Another process holds 30 GiB: 80 - 16 - 30 = 34 GiB free; less 4 GiB activations.
    s = cuda(80 * GiB, 16 * GiB, 4 * GiB, free=34 * GiB)
    assert s.budget_bytes == 30 * GiB


def test_explicit_block_count_wins_over_everything():
    s = cpu(1 * MiB, num_kv_blocks=7, kv_cache_memory_bytes=GiB)
    assert (s.rule, s.num_blocks) == ("num_kv_blocks", 7)
    assert s.describe().endswith("(--num-kv-blocks)")
    assert size_kv_pool(
        block_bytes=100, block_size=16, device="cpu", max_model_len=10, max_num_seqs=1,
        num_kv_blocks=3,
    ).num_blocks == 3  # fmt: skip


def test_explicit_bytes_win_over_the_machine():
    s = cpu(1 * MiB, kv_cache_memory_bytes=GiB)
    assert (s.rule, s.num_blocks) == ("kv_cache_memory", GiB // SMOL_BLOCK)
    assert "--kv-cache-memory 1.00 GiB" in s.describe()
    with pytest.raises(ValueError, match="less than one KV block"):
        cpu(8 * GiB, kv_cache_memory_bytes=SMOL_BLOCK - 1)


def test_a_tiny_machine_is_refused_with_the_figures_and_the_flags():
    # 40 MiB available, half of it: 28 blocks; a 1024-token sequence needs 64.
    with pytest.raises(ValueError) as err:
        cpu(40 * MiB)
    message = str(err.value)
    for part in (
        "0.5 of 40 MiB RAM available",
        "28 blocks",
        "needs 64 blocks",
        "--kv-cache-memory",
    ):
        assert part in message
    assert "--num-kv-blocks" in message and "--cpu-kv-cache-share" in message
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        cuda(16 * GiB, 14 * GiB, 1 * GiB)  # 0.9 * 16 - 15 GiB < 0: nothing left
    # A model shorter than MIN_AUTO_TOKENS needs only its own length.
    assert cpu(40 * MiB, max_model_len=256).num_blocks == 28


def test_shares_outside_zero_one_are_refused():
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="cpu_kv_cache_share"):
            cpu(8 * GiB, cpu_kv_cache_share=bad)
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            cuda(80 * GiB, 0, 0, gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="cpu_kv_cache_share"):
        EngineConfig(model="m", cpu_kv_cache_share=0.0)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineConfig(model="m", kv_cache_memory_bytes=0)


# --------------------------------------------------------------------------- properties
sizes = st.integers(min_value=0, max_value=2**42)


@given(
    available=sizes,
    share=st.floats(min_value=0.01, max_value=1.0),
    block_bytes=st.integers(1, 2**22),
    max_model_len=st.integers(1, 2**17),
    max_num_seqs=st.integers(1, 1024),
)
def test_cpu_pool_within_share_cap_and_minimum(
    available, share, block_bytes, max_model_len, max_num_seqs
):
    kw = {"block_bytes": block_bytes, "block_size": 16, "device": "cpu"}
    kw |= {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
    need = -(-min(max_model_len, 1024) // 16)
    try:
        s = size_kv_pool(**kw, cpu_kv_cache_share=share, memory=MemoryFigures(available))
    except ValueError:
        assert int(share * available) // block_bytes < need
        return
    assert need <= s.num_blocks <= max_num_seqs * -(-max_model_len // 16)
    assert s.pool_bytes <= share * available
    more = size_kv_pool(**kw, cpu_kv_cache_share=share, memory=MemoryFigures(available * 2))
    assert more.num_blocks >= s.num_blocks


@given(
    total=sizes,
    weights=sizes,
    activation=sizes,
    free=st.one_of(st.none(), sizes),
    util=st.floats(min_value=0.01, max_value=1.0),
    block_bytes=st.integers(1, 2**22),
)
def test_cuda_pool_plus_weights_and_activations_within_the_budget(
    total, weights, activation, free, util, block_bytes
):
    memory = MemoryFigures(
        total, weights_bytes=weights, activation_bytes=activation, free_bytes=free
    )
    kw = {"block_bytes": block_bytes, "block_size": 16, "device": "cuda", "max_model_len": 4096}
    try:
        s = size_kv_pool(**kw, max_num_seqs=8, gpu_memory_utilization=util, memory=memory)
    except ValueError:
        return
    assert s.pool_bytes + weights + activation <= util * total + 1
    if free is not None:
        assert s.pool_bytes + activation <= free
    assert s.num_blocks >= 64


# ----------------------------------------------------------------------- machine figures
def test_mem_available_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16000000 kB\nMemFree: 100 kB\nMemAvailable: 8000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert kv_profile.mem_available_bytes(meminfo, cg) == 8000000 * 1024  # no limit file
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("123\n")
    assert kv_profile.mem_available_bytes(meminfo, cg) == 8000000 * 1024  # "max": no limit
    (cg / "memory.max").write_text(f"{2 * GiB}\n")
    (cg / "memory.current").write_text(f"{GiB // 2}\n")
    assert kv_profile.mem_available_bytes(meminfo, cg) == GiB * 3 // 2  # the container's
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{GiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{2 * GiB}\n")
    assert kv_profile.mem_available_bytes(meminfo, v1) == 0  # over its limit already


def test_profile_forward_is_a_real_step(tiny_text_dir, hf_text):
    """The dummy step's logits equal transformers' for the same all-zero prompts."""
    from loraplex.engine.attention import get_attention_backend
    from loraplex.engine.models.loader import load_model

    hf, _ = hf_text
    model, _ = load_model(tiny_text_dir, torch.float32, torch.device("cpu"))
    logits = kv_profile.profile_forward(
        model,
        get_attention_backend("torch"),
        num_tokens=40,
        max_model_len=16,
        block_size=16,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    assert logits.shape == (3, model.vocab_size)  # prompts of 16, 16 and 8 tokens
    with torch.no_grad():
        want = [hf(torch.zeros((1, n), dtype=torch.long)).logits[0, -1] for n in (16, 16, 8)]
    torch.testing.assert_close(logits, torch.stack(want), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- the engine
def test_engine_sizes_its_pool_from_available_memory(tiny_text_dir, monkeypatch):
    monkeypatch.setattr(kv_profile, "mem_available_bytes", lambda: 4 * MiB)
    llm = LLM(EngineConfig(model=tiny_text_dir, max_num_seqs=4, device="cpu"))  # the CPU rule
    sizing = llm.engine.kv_sizing
    # Tiny model: 4 layers x 16 tokens x 2 KV heads x 16 x K,V x 4 bytes = 16 KiB a block.
    assert sizing.block_bytes == 16 * 1024 and sizing.rule == "cpu_kv_cache_share"
    assert sizing.num_blocks == llm.engine.kv.pool.num_blocks == 128  # 2 MiB of 16 KiB blocks
    assert llm.config.num_kv_blocks == 128
    assert llm.engine.runner.kv_caches[0][0].shape[0] == 128
    assert llm.engine.max_model_len == 128 * 16  # the model's 4096 clamped to the pool


def test_engine_refuses_to_start_on_a_tiny_machine(tiny_text_dir, monkeypatch):
    monkeypatch.setattr(kv_profile, "mem_available_bytes", lambda: 1 * MiB)
    with pytest.raises(ValueError, match="not enough memory for the KV cache"):
        LLM(EngineConfig(model=tiny_text_dir, device="cpu"))  # the CPU rule
    # An explicit size needs no figures and starts.
    llm = LLM(EngineConfig(model=tiny_text_dir, kv_cache_memory_bytes=MiB))
    assert llm.engine.kv_sizing.rule == "kv_cache_memory" and llm.engine.kv.pool.num_blocks == 64


# ------------------------------------------------------------------------------- flags
def test_parse_size():
    assert parse_size("1073741824") == GiB
    assert parse_size("4GiB") == parse_size("4 gib") == 4 * GiB
    assert parse_size("1.5GiB") == 3 * GiB // 2
    assert parse_size("512MiB") == 512 * MiB and parse_size("2KiB") == 2048
    assert parse_size("10B") == 10
    for bad in ("4GB", "4G", "", "GiB", "-1GiB", "0", "nan", "inf", "0.1B", "4 XiB"):
        with pytest.raises(ValueError, match="bad size"):
            parse_size(bad)


def engine_flags(*argv):
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.engine_args import config_from_args

    args = build_parser().parse_args(["serve", *argv])
    return config_from_args(args, "model-dir")


def test_serve_flags_reach_the_engine_config():
    d = engine_flags()
    assert d.num_kv_blocks is None and d.kv_cache_memory_bytes is None
    assert (d.gpu_memory_utilization, d.cpu_kv_cache_share) == (0.9, 0.5)
    c = engine_flags(
        "--kv-cache-memory", "2GiB", "--gpu-memory-utilization", "0.8",
        "--cpu-kv-cache-share", "0.25", "--num-kv-blocks", "9",
    )  # fmt: skip
    assert (c.kv_cache_memory_bytes, c.num_kv_blocks) == (2 * GiB, 9)
    assert (c.gpu_memory_utilization, c.cpu_kv_cache_share) == (0.8, 0.25)
    with pytest.raises(SystemExit):
        engine_flags("--kv-cache-memory", "2GB")
    with pytest.raises(ValueError, match="cpu_kv_cache_share"):
        engine_flags("--cpu-kv-cache-share", "1.5")


def test_cpu_pool_tensors_are_zero_writable_and_lazily_backed():
    import gc

    t = kv_profile.pool_zeros((64, 16, 2, 8), torch.float16, torch.device("cpu"))
    assert t.shape == (64, 16, 2, 8) and t.dtype == torch.float16 and t.is_contiguous()
    assert not t.any()
    t[3, 1] = 2.5
    gc.collect()  # the map lives as long as the tensor
    assert t[3, 1].eq(2.5).all() and t.sum().item() == 2.5 * 16
    assert kv_profile.pool_zeros((0, 16), torch.float32, torch.device("cpu")).shape == (0, 16)
