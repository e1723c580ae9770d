"""In-place CPU decode attention (compiled FlexAttention) against the gathered reference.

Every block no sequence owns is NaN, so a read of another sequence's block turns the output
NaN; the unused tail of each sequence's last block holds large finite garbage (1e4), so a tail
the mask failed to drop shows. (Not NaN: the kernel drops masked positions by giving them
probability 0, and 0 * NaN is NaN; the engine's pool starts zeroed and only ever holds written
K/V, so a tail is finite there. The gathered reference zeroes tails, docs/kernels.md.)
Block tables are shuffled.
"""

import pytest
import torch

from loraplex.engine.attention import AttentionMetadata
from loraplex.engine.attention.backend import TorchAttentionBackend
from loraplex.kernels import paged_attention_flex
from loraplex.kernels.paged_attention_flex import PagedDecodeMask, batch_bucket, paged_decode_flex
from loraplex.kernels.paged_attention_ref import paged_attention_ref

# Compiles FlexAttention per shape: the slow tier (the fast tier keeps the engine parity runs of
# the path in tests/engine/test_engine_parity.py).
pytestmark = pytest.mark.slow


def decode_case(lens, heads, kv_heads, head_dim, block_size, num_blocks=64, seed=0):
    """Shuffled tables over a NaN cache; only the sequences' own blocks hold numbers."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in lens) + 1  # one spare column: 0-padded
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        own = [perm.pop() for _ in range(-(-n // block_size))]
        tables[b, : len(own)] = torch.tensor(own)
        k_cache[own[-1]] = 1e4
        v_cache[own[-1]] = 1e4
        for pos in range(n):
            blk, off = own[pos // block_size], pos % block_size
            k_cache[blk, off] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[blk, off] = torch.randn(kv_heads, head_dim, generator=gen)
    query = torch.randn(len(lens), heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return query, k_cache, v_cache, tables, seq_lens


def reference(query, k_cache, v_cache, tables, seq_lens, scale):
    return paged_attention_ref(
        query, k_cache, v_cache, tables, seq_lens,
        torch.arange(len(seq_lens) + 1, dtype=torch.int32), scale,
        max_query_len=1, max_seq_len=int(seq_lens.max()),
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 8), (9, 3, 64), (4, 4, 16)])
@pytest.mark.parametrize(
    "lens",
    [[1], [37], [16, 1, 33, 48, 5], [2, 70, 3]],
    ids=["one-token", "one-seq", "ragged", "padded-to-4"],
)
def test_flex_decode_matches_reference(block_size, heads, kv_heads, head_dim, lens):
    case = decode_case(lens, heads, kv_heads, head_dim, block_size)
    query, k_cache, v_cache, tables, seq_lens = case
    scale = head_dim**-0.5
    mask = PagedDecodeMask(tables, seq_lens, k_cache.shape[0], block_size, heads // kv_heads)
    got = paged_decode_flex(query, k_cache, v_cache, mask, scale)
    want = reference(*case, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 33, 256, 257)] == [1, 2, 4, 8, 64, 256, 512]


def test_mask_for_another_cache_is_refused():
    query, k_cache, v_cache, tables, seq_lens = decode_case([5, 9], 4, 2, 8, 4)
    mask = PagedDecodeMask(tables, seq_lens, k_cache.shape[0] + 1, 4, 2)
    with pytest.raises(ValueError, match="mask built for"):
        paged_decode_flex(query, k_cache, v_cache, mask, 0.3)


def step(lens, q_lens, seed):
    """A step over a NaN cache: metadata, queries and this step's new K/V (to be written)."""
    gen = torch.Generator().manual_seed(seed)
    _, k_cache, v_cache, tables, seq_lens = decode_case(lens, 4, 2, 8, 4, seed=seed)
    keys, values, slots = [], [], []
    for b, n in enumerate(q_lens):
        for pos in range(lens[b] - n, lens[b]):
            slots.append(int(tables[b, pos // 4]) * 4 + pos % 4)
            keys.append(torch.randn(2, 8, generator=gen))
            values.append(torch.randn(2, 8, generator=gen))
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        num_decode_tokens=sum(1 for n in q_lens if n == 1),
    )
    query = torch.randn(sum(q_lens), 4, 8, generator=gen)
    return query, torch.stack(keys), torch.stack(values), k_cache, v_cache, meta


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 4, 1]], ids=["decode-only", "mixed"])
def test_backend_flex_equals_gather(q_lens):
    query, keys, values, k_cache, v_cache, meta = step([23, 40, 7], q_lens, seed=3)
    outs = {}
    for mode in ("gather", "flex"):
        backend = TorchAttentionBackend(mode)
        kc, vc = k_cache.clone(), v_cache.clone()
        # Two layers of one step: the flex mask is built once and reused.
        outs[mode] = [backend.forward(query, keys, values, kc, vc, meta, 0.35) for _ in range(2)]
        if mode == "flex":
            assert backend.cpu_decode == "flex"
            assert (backend._mask_meta is meta) == (q_lens == [1, 1, 1])  # mixed: reference
    for want, got in zip(outs["gather"], outs["flex"], strict=True):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_backend_falls_back_when_the_kernel_fails(monkeypatch, caplog):
    query, keys, values, k_cache, v_cache, meta = step([9, 30], [1, 1], seed=4)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(paged_attention_flex, "paged_decode_flex", broken)
    backend = TorchAttentionBackend("flex")
    got = backend.forward(query, keys, values, k_cache.clone(), v_cache.clone(), meta, 0.35)
    assert backend.cpu_decode == "gather"
    assert "no C++ compiler" in caplog.text
    want = TorchAttentionBackend().forward(query, keys, values, k_cache, v_cache, meta, 0.35)
    torch.testing.assert_close(got, want)


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="cpu_decode_attention"):
        TorchAttentionBackend("paged")


@pytest.mark.parametrize(
    "fields",
    [{"device": "cuda"}, {"attention_backend": "triton"}, {"dtype": "bfloat16"}],
    ids=["cuda", "triton", "bfloat16"],
)
def test_flex_where_it_would_not_run_is_refused(fields):
    from loraplex.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_decode_attention flex is the torch backend's"):
        EngineConfig(model="m", cpu_decode_attention="flex", **{"device": "cpu", **fields})
