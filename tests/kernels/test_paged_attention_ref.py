"""The torch paged-attention reference against plain SDPA on contiguous K/V.

The reference (the torch attention backend's kernel) runs on the ``test_device``; the
contiguous oracle on the CPU.
"""

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels.paged_attention_ref import paged_attention_ref, reshape_and_cache_ref


def contiguous_attention(q, k, v, ctx_len, sliding_window=None, sinks=None):
    """q: [Q, H, D] at positions ctx_len.., k/v: [L, Hkv, D] -> [Q, H, D].

    ``sinks`` ([H]): gpt-oss's attention sinks as transformers' eager attention applies them, a
    softmax logit per head over no value.
    """
    num_q, heads, dim = q.shape
    length, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    qpos = torch.arange(ctx_len, ctx_len + num_q)[:, None]
    kpos = torch.arange(length)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    if sinks is not None:
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.view(-1, 1, 1).expand(-1, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, v)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_matches_contiguous_attention(test_device, block_size, heads, kv_heads, window, with_sinks):
    gen = torch.Generator().manual_seed(0)
    sinks = torch.randn(heads, generator=gen) * 2 if with_sinks else None
    head_dim = 8
    # (context already cached, new query tokens): decode, prefill, prefix-hit prefill, chunk.
    seqs = [(9, 1), (0, 13), (8, 5), (20, 7), (0, 1)]
    num_blocks = 64
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous
    max_blocks = max(-(-(c + n) // block_size) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    full_k, full_v, queries, slots = [], [], [], []
    for b, (ctx, new) in enumerate(seqs):
        length = ctx + new
        nb = -(-length // block_size)
        ids = [perm.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(ids)
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        full_k.append(k)
        full_v.append(v)
        seq_slots = torch.tensor(
            [ids[p // block_size] * block_size + p % block_size for p in range(length)]
        )
        # The cached context is already there; the new tokens are written by the step.
        reshape_and_cache_ref(k[:ctx], v[:ctx], k_cache, v_cache, seq_slots[:ctx])
        slots.append(seq_slots[ctx:])
        queries.append(torch.randn(new, heads, head_dim, generator=gen))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    reshape_and_cache_ref(new_k, new_v, k_cache, v_cache, torch.cat(slots))
    q = torch.cat(queries)
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    on = [t.to(test_device) for t in (q, k_cache, v_cache, tables, seq_lens, qsl)]
    out = paged_attention_ref(
        *on,
        head_dim**-0.5,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=int(seq_lens.max()),
        sliding_window=window,
        sinks=None if sinks is None else sinks.to(test_device),
    )
    assert out.device == test_device
    out = out.cpu()
    assert out.shape == q.shape
    for b, (ctx, _) in enumerate(seqs):
        ref = contiguous_attention(queries[b], full_k[b], full_v[b], ctx, window, sinks)
        torch.testing.assert_close(out[qsl[b] : qsl[b + 1]], ref, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(out).any()
