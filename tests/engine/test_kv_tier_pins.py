"""The KV cache manager's pins for KV tier transfers, and the pool <-> payload copies.

Block size 4; requests as in test_kv_cache_manager (tokens + their block hasher).
"""

import pytest
import torch

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.runner.kv_transfer import gather_blocks, scatter_blocks
from loraplex.hashing.request_hasher import RequestBlockHasher

BS = 4


def hashes_of(tokens, **extra):
    hasher = RequestBlockHasher(BS, **extra)
    hasher.extend(tokens)
    return hasher.block_hashes


def run_and_free(manager, rid, tokens):
    hs = hashes_of(tokens)
    manager.allocate_slots(rid, len(tokens), block_hashes=hs)
    manager.free(rid)
    return hs


def test_a_pinned_cached_block_is_not_evicted_and_comes_back_cached():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    hs = run_and_free(m, "a", list(range(8)))  # two cached blocks, both free
    pinned = m.pin_cached(hs[:1])
    assert [b.block_hash for b in pinned] == hs[:1] and m.num_pinned == 1
    # Every other block is taken (evicting the unpinned one); the pinned one is not free.
    assert m.pin_new(4) is None
    fresh = m.pin_new(3)
    assert fresh is not None and pinned[0] not in fresh
    assert m.get_computed_blocks(hs, 9).num_cached_tokens == BS  # hs[1] was evicted
    m.unpin(fresh)
    m.unpin(pinned)
    assert m.num_pinned == 0 and m.num_free_blocks == 4
    assert m.get_computed_blocks(hs, 9).num_cached_tokens == BS  # still cached after unpin


def test_pin_cached_skips_hashes_that_are_not_cached():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    hs = run_and_free(m, "a", list(range(4)))
    other = hashes_of(list(range(100, 104)))
    assert m.pin_cached(other + hs) == [m.pool.cached[hs[0]]]


def test_loaded_blocks_register_under_their_hashes_and_a_later_request_hits_them():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    hs = hashes_of(list(range(12)))
    fresh = m.pin_new(2)
    assert m.register_loaded(fresh, hs[:2]) == 2
    m.unpin(fresh[::-1])
    match = m.get_computed_blocks(hs, 12)
    assert match.num_cached_tokens == 8 and list(match.blocks) == fresh


def test_a_loaded_copy_of_a_hash_already_cached_stays_unhashed():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    hs = run_and_free(m, "a", list(range(4)))
    computed = m.pool.cached[hs[0]]
    fresh = m.pin_new(1)
    assert m.register_loaded(fresh, hs[:1]) == 0
    assert fresh[0].block_hash is None and m.pool.cached[hs[0]] is computed
    m.unpin(fresh)


def _caches(num_blocks, layers=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, 2, 8)
    return [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(layers)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_scatter_moves_every_layers_k_and_v(dtype):
    src, dst = _caches(6, dtype=dtype), _caches(6, dtype=dtype, seed=1)
    before = [(k.clone(), v.clone()) for k, v in dst]
    payloads = gather_blocks(src, [4, 1])
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert [p.numel() for p in payloads] == [3 * 2 * BS * 2 * 8 * itemsize] * 2
    assert all(p.dtype == torch.uint8 and p.is_contiguous() for p in payloads)
    # Each payload owns its storage: a tier that keeps one does not keep the others alive.
    assert payloads[0].untyped_storage().data_ptr() != payloads[1].untyped_storage().data_ptr()
    scatter_blocks(dst, [0, 5], payloads)
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before, strict=True):
        assert torch.equal(dk[0], sk[4]) and torch.equal(dv[0], sv[4])
        assert torch.equal(dk[5], sk[1]) and torch.equal(dv[5], sv[1])
        assert torch.equal(dk[1:5], bk[1:5]) and torch.equal(dv[1:5], bv[1:5])  # untouched


def test_scatter_refuses_a_payload_of_the_wrong_size():
    dst = _caches(2)
    with pytest.raises(ValueError, match="uint8 bytes"):
        scatter_blocks(dst, [0], [torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="payloads"):
        scatter_blocks(dst, [0, 1], gather_blocks(dst, [0]))
