"""Queries that see past themselves (an image attended bidirectionally) in the torch reference.

The oracle mask is transformers' own: ``or_masks(causal, blockwise_overlay(groups))`` for full
attention and ``and_masks(sliding_window_overlay(W), that)`` for sliding layers, what Gemma 3's
``create_masks_for_vision_model`` builds, evaluated index by index; attention over contiguous
K/V with it is the reference the paged kernel must match.
"""

import pytest
import torch

from loraplex.kernels.paged_attention_ref import paged_attention_ref, reshape_and_cache_ref


def hf_mask(length: int, groups: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[length, length]`` bool from transformers' mask functions (batch 0, head 0)."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )

    fn = or_masks(causal_mask_function, blockwise_overlay(groups[None]))
    if window is not None:
        fn = and_masks(sliding_window_overlay(window), fn)
    zero, idx = torch.tensor(0), [torch.tensor(i) for i in range(length)]
    return torch.tensor([[bool(fn(zero, zero, q, k)) for k in idx] for q in idx])


def dense(q, k, v, mask, cap=None):
    """``[Q, H, D]`` attention of the last ``Q`` positions over contiguous ``[L, Hkv, D]``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    v = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask[-q.shape[0] :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("cap", [None, 20.0])
def test_image_spans_see_each_other(test_device, window, cap):
    gen = torch.Generator().manual_seed(0)
    block, heads, kv_heads, dim = 4, 4, 2, 8
    # Sequence 0: 5 cached tokens, then a 14-token chunk holding two images [7, 11) and
    # [13, 17) (a cached prefix may end inside none of them). Sequence 1: a plain decode.
    # Sequence 2: a plain 6-token prefill.
    seqs = [(5, 14, [(7, 11), (13, 17)]), (9, 1, []), (0, 6, [])]
    k_cache = torch.full((32, block, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.zeros(3, 8, dtype=torch.int32)
    next_block = iter(torch.randperm(32, generator=gen).tolist())
    qs, bounds, refs_in = [], [], []
    for b, (ctx, new, images) in enumerate(seqs):
        length = ctx + new
        ids = [next(next_block) for _ in range(-(-length // block))]
        tables[b, : len(ids)] = torch.tensor(ids)
        slots = torch.tensor([ids[p // block] * block + p % block for p in range(length)])
        k = torch.randn(length, kv_heads, dim, generator=gen)
        v = torch.randn(length, kv_heads, dim, generator=gen)
        reshape_and_cache_ref(k, v, k_cache, v_cache, slots)
        q = torch.randn(new, heads, dim, generator=gen)
        groups = torch.full((length,), -1)
        bound = torch.arange(ctx, length)
        for g, (s, e) in enumerate(images):
            groups[s:e] = g
            bound[s - ctx : e - ctx] = e - 1
        qs.append(q)
        bounds.append(bound)
        refs_in.append((q, k, v, hf_mask(length, groups, window)))
    qsl = torch.tensor([0] + [n for _, n, _ in seqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n, _ in seqs], dtype=torch.int32)
    args = [t.to(test_device) for t in (torch.cat(qs), k_cache, v_cache, tables, seq_lens, qsl)]
    out = paged_attention_ref(
        *args, dim**-0.5,
        max_query_len=14, max_seq_len=19, sliding_window=window, logits_soft_cap=cap,
        visible_up_to=torch.cat(bounds).to(test_device),
    ).cpu()  # fmt: skip
    for b, (q, k, v, mask) in enumerate(refs_in):
        expected = dense(q, k, v, mask, cap)
        torch.testing.assert_close(out[qsl[b] : qsl[b + 1]], expected, atol=1e-5, rtol=1e-5)
    causal = paged_attention_ref(
        *args, dim**-0.5,
        max_query_len=14, max_seq_len=19, sliding_window=window, logits_soft_cap=cap,
    ).cpu()  # fmt: skip
    assert not torch.allclose(causal[: qsl[1]], out[: qsl[1]])  # the images' rows differ
    torch.testing.assert_close(causal[qsl[1] :], out[qsl[1] :])  # the other sequences do not


def test_a_kernel_without_it_falls_back_to_the_reference(test_device):
    """A backend whose kernel takes no ``visible_up_to`` (Triton) runs the reference then."""
    from loraplex.engine.attention.backend import PagedKernelBackend, TorchAttentionBackend
    from loraplex.engine.attention.metadata import AttentionMetadata

    def causal_only(*args, **kwargs):
        assert "visible_up_to" not in kwargs
        return paged_attention_ref(*args, **kwargs)

    kernel = PagedKernelBackend("causal-only", reshape_and_cache_ref, causal_only)
    gen = torch.Generator().manual_seed(1)
    dev = test_device
    q, k, v = (torch.randn(6, 2, 8, generator=gen).to(dev) for _ in range(3))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(6, device=dev),
        query_start_loc=torch.tensor([0, 6], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([6], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32, device=dev),
        max_query_len=6,
        max_seq_len=6,
        visible_up_to=torch.tensor([0, 3, 3, 3, 4, 5], device=dev),  # an image at 1..3
    )
    outs = []
    for backend in (kernel, TorchAttentionBackend()):
        caches = torch.zeros(2, 4, 2, 8, device=dev), torch.zeros(2, 4, 2, 8, device=dev)
        outs.append(backend.forward(q, k, v, *caches, meta, 8**-0.5))
    torch.testing.assert_close(outs[0], outs[1])
    causal = kernel.forward(q, k, v, *caches, _causal(meta), 8**-0.5)
    assert not torch.allclose(causal[1:3], outs[0][1:3])


def _causal(meta):
    import dataclasses

    return dataclasses.replace(meta, visible_up_to=None)
