"""Deterministic tests of the KV cache manager: exact block ids, ref counts and eviction order.

Block size 4 throughout; requests come from ``make_request`` (tokens + their block hasher).
"""

from dataclasses import dataclass, field

import pytest

from loraplex.engine.kv_cache import BlockCopy, BlockTable, KVCacheManager
from loraplex.hashing.extra_keys import MMPlaceholder
from loraplex.hashing.request_hasher import RequestBlockHasher

BS = 4


@dataclass
class Req:
    request_id: str
    tokens: list[int]
    hasher: RequestBlockHasher
    table: BlockTable = field(default_factory=lambda: BlockTable(BS))
    num_computed: int = 0


def make_request(request_id, tokens, **extra):
    hasher = RequestBlockHasher(BS, **extra)
    hasher.extend(tokens)
    return Req(request_id, list(tokens), hasher)


def schedule(manager, req):
    """Admit a new request: prefix lookup, then room for the rest of its prompt."""
    match = manager.get_computed_blocks(req.hasher.block_hashes, len(req.tokens))
    alloc = manager.allocate_slots(
        req.request_id,
        len(req.tokens) - match.num_cached_tokens,
        prefix=match,
        block_hashes=req.hasher.block_hashes,
        stat_sources=req.hasher.stat_sources(),
    )
    if alloc is not None:
        req.table.apply(alloc)
        req.num_computed = len(req.tokens)
    return match, alloc


def decode(manager, req, token):
    req.tokens.append(token)
    req.hasher.extend([token])
    alloc = manager.allocate_slots(
        req.request_id,
        1,
        num_computed_tokens=req.num_computed,
        block_hashes=req.hasher.block_hashes,
    )
    if alloc is not None:
        req.table.apply(alloc)
        req.num_computed += 1
    return alloc


def ref_counts(manager):
    return [b.ref_cnt for b in manager.pool.blocks]


def free_order(manager):
    return [b.block_id for b in manager.pool.free_queue]


def test_prefill_then_hit_for_a_shared_prefix():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    match, alloc = schedule(m, a)
    assert match.num_cached_tokens == 0
    assert alloc.new_block_ids == [0, 1, 2]
    assert [m.pool.blocks[i].block_hash for i in (0, 1)] == a.hasher.block_hashes
    assert m.pool.blocks[2].block_hash is None  # partial: never cached

    b = make_request("b", list(range(8)) + [99, 98, 97])
    match, alloc = schedule(m, b)
    assert match.num_cached_tokens == 8 and match.block_ids == [0, 1]
    assert alloc.new_block_ids == [0, 1, 3]
    assert ref_counts(m)[:4] == [2, 2, 1, 1]
    assert m.stats.total.queried_tokens == 21 and m.stats.total.hit_tokens == 8


def test_hit_is_capped_at_num_tokens_minus_one():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(m, a)
    m.free("a")
    b = make_request("b", list(range(8)))  # exactly two full blocks, both cached
    match, alloc = schedule(m, b)
    assert match.num_cached_tokens == 4  # the last token must be computed: block 1 recomputed
    assert alloc.new_block_ids[0] == match.block_ids[0]
    assert len(alloc.new_block_ids) == 2


def test_eviction_order_after_freeing():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(12)))  # blocks 0,1,2 (all full)
    b = make_request("b", list(range(100, 108)))  # blocks 3,4
    schedule(m, a)
    schedule(m, b)
    assert free_order(m) == [5, 6, 7]
    m.free("a")  # tail first: 2, 1, 0
    m.free("b")  # later, so evicted later: 4, 3
    assert free_order(m) == [5, 6, 7, 2, 1, 0, 4, 3]
    c = make_request("c", list(range(200, 220)))  # needs 5 blocks: 3 never-used, then 2, 1
    _, alloc = schedule(m, c)
    assert alloc.new_block_ids == [5, 6, 7, 2, 1]
    assert free_order(m) == [0, 4, 3]


def test_a_block_reused_after_eviction_has_lost_its_hash():
    m = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(m, a)
    old_hashes = [m.pool.blocks[i].block_hash for i in (0, 1)]
    m.free("a")
    assert set(m.pool.cached) == set(old_hashes)
    b = make_request("b", list(range(50, 62)))  # 3 blocks: evicts everything
    _, alloc = schedule(m, b)
    assert sorted(alloc.new_block_ids) == [0, 1, 2]
    assert all(h not in m.pool.cached for h in old_hashes)
    for block in m.pool.blocks:
        assert block.block_hash in (None, *b.hasher.block_hashes)
    assert m.pool.num_evictions == 2
    m.free("b")
    match = m.get_computed_blocks(a.hasher.block_hashes, 8)
    assert match.num_cached_tokens == 0


def test_blocks_held_by_a_running_request_are_never_evicted():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(m, a)
    b = make_request("b", list(range(50, 58)))
    _, alloc = schedule(m, b)
    assert alloc.new_block_ids == [2, 3]
    c = make_request("c", list(range(90, 94)))
    assert schedule(m, c) == (m.get_computed_blocks(c.hasher.block_hashes, 4), None)
    assert m.get_block_ids("a") == [0, 1] and m.get_block_ids("b") == [2, 3]
    assert [b.block_hash for b in m.pool.blocks[:2]] == a.hasher.block_hashes


def test_allocation_that_does_not_fit_changes_nothing():
    m = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(m, a)
    m.free("a")  # blocks 0, 1 cached and free
    before = (free_order(m), ref_counts(m), dict(m.pool.cached), m.stats.total.requests)
    # Shares a's first block (a hit that would revive it) but needs 6 blocks in all.
    big = make_request("big", list(range(4)) + list(range(300, 320)))
    match, alloc = schedule(m, big)
    assert match.num_cached_tokens == 4 and alloc is None
    assert (free_order(m), ref_counts(m), dict(m.pool.cached), m.stats.total.requests) == before
    assert "big" not in m and m.get_block_ids("big") == []


@pytest.mark.parametrize(
    "first, second",
    [
        (dict(lora_digest="adapter-1"), dict(lora_digest="adapter-2")),
        (dict(lora_digest="adapter-1"), dict()),
        (dict(cache_salt="tenant-a"), dict(cache_salt="tenant-b")),
        (dict(cache_salt="tenant-a"), dict()),
        (
            dict(placeholders=[MMPlaceholder("img-1", 0, 6)]),
            dict(placeholders=[MMPlaceholder("img-2", 0, 6)]),
        ),
        (
            dict(placeholders=[MMPlaceholder("img-1", 0, 6)]),
            dict(placeholders=[MMPlaceholder("img-1", 1, 6)]),
        ),
    ],
    ids=["adapter", "adapter-vs-base", "salt", "salt-vs-none", "image-key", "image-offset"],
)
def test_different_extra_keys_give_zero_hits_on_the_same_tokens(first, second):
    m = KVCacheManager(num_blocks=12, block_size=BS)
    tokens = list(range(13))
    schedule(m, make_request("a", tokens, **first))
    match, _ = schedule(m, make_request("b", tokens, **second))
    assert match.num_cached_tokens == 0
    match, _ = schedule(m, make_request("c", tokens, **first))
    assert match.num_cached_tokens == 12  # the same keys again: every full block hits


def test_hit_rate_per_source():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = list(range(9))
    for rid in ("a1", "a2"):
        schedule(m, make_request(rid, tokens, lora_digest="A", cache_salt="t1"))
    schedule(m, make_request("b1", tokens, lora_digest="B", cache_salt="t1"))
    assert m.stats.by_source[("lora", "A")].hit_tokens == 8
    assert m.stats.by_source[("lora", "A")].queried_tokens == 18
    assert m.stats.hit_rate(("lora", "B")) == 0.0
    assert m.stats.by_source[("salt", "t1")].requests == 3
    assert m.stats.hit_rate() == pytest.approx(8 / 27)


def test_prefix_caching_disabled_still_allocates_and_frees():
    m = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(10)))
    match, alloc = schedule(m, a)
    assert alloc.new_block_ids == [0, 1, 2] and not m.pool.cached
    for t in range(3):  # 10 -> 13 tokens: one more block at token 13
        decode(m, a, 100 + t)
    assert m.get_block_ids("a") == [0, 1, 2, 3] == a.table.block_ids
    b = make_request("b", list(range(10)))
    match, alloc = schedule(m, b)
    assert match.num_cached_tokens == 0 and alloc is None  # needs 3, only 2 free
    assert m.free("a") == 4
    assert m.num_free_blocks == 6 and not m.pool.cached
    assert all(b.block_hash is None for b in m.pool.blocks)
    _, alloc = schedule(m, b)
    assert len(alloc.new_block_ids) == 3
    assert m.stats.total.requests == 0


def test_decode_caches_blocks_as_they_fill():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(6)))
    schedule(m, a)
    assert len(m.pool.cached) == 1
    decode(m, a, 6)
    decode(m, a, 7)  # block 1 is now full
    assert len(m.pool.cached) == 2
    assert m.pool.blocks[a.table[1]].block_hash == a.hasher.block_hashes[1]
    b = make_request("b", list(range(8)) + [1])
    match, _ = schedule(m, b)
    assert match.num_cached_tokens == 8  # generated tokens are reusable too


def test_fork_and_copy_on_write():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_request("p", list(range(6)))  # block 0 full, block 1 partial (2 tokens)
    schedule(m, parent)
    m.fork("p", "c")
    child = Req(
        "c",
        list(parent.tokens),
        parent.hasher.fork(),
        BlockTable(BS, parent.table),
        parent.num_computed,
    )
    assert m.get_block_ids("c") == [0, 1]
    assert ref_counts(m)[:2] == [2, 2]
    # The child writes first into the shared partial block: it gets a copy.
    alloc = decode(m, child, 42)
    assert alloc.copies == [BlockCopy(logical_index=1, src=1, dst=2)]
    assert alloc.new_block_ids == []
    assert m.get_block_ids("c") == [0, 2] == child.table.block_ids
    assert m.get_block_ids("p") == [0, 1]
    assert ref_counts(m)[:3] == [2, 1, 1]
    # The parent now owns block 1 alone: no copy.
    alloc = decode(m, parent, 7)
    assert alloc.copies == [] and m.get_block_ids("p") == [0, 1]
    # Both fill their block 1 with different tokens: different hashes, both cached.
    decode(m, parent, 8)
    decode(m, child, 43)
    assert parent.hasher.block_hashes[1] != child.hasher.block_hashes[1]
    assert m.pool.blocks[1].block_hash == parent.hasher.block_hashes[1]
    assert m.pool.blocks[2].block_hash == child.hasher.block_hashes[1]
    m.free("p")
    m.free("c")
    assert m.num_free_blocks == 8 and all(c == 0 for c in ref_counts(m))


def test_fork_on_a_block_boundary_needs_no_copy():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_request("p", list(range(8)))
    schedule(m, parent)
    m.fork("p", "c")
    child = Req("c", list(parent.tokens), parent.hasher.fork(), BlockTable(BS, parent.table), 8)
    alloc = decode(m, child, 1)
    assert alloc.copies == [] and alloc.new_block_ids == [2]
    with pytest.raises(ValueError, match="already holds"):
        m.fork("p", "c")
    with pytest.raises(KeyError):
        m.fork("nobody", "x")


def test_reset_refused_while_blocks_are_in_use():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(m, a)
    cached = dict(m.pool.cached)
    assert m.reset_prefix_cache() is False
    assert m.pool.cached == cached
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert not m.pool.cached and all(b.block_hash is None for b in m.pool.blocks)
    match, _ = schedule(m, make_request("b", list(range(8))))
    assert match.num_cached_tokens == 0


def test_chunked_prefill_grows_the_table_by_append():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(14)))
    match = m.get_computed_blocks(a.hasher.block_hashes, 14)
    alloc = m.allocate_slots("a", 5, prefix=match, block_hashes=a.hasher.block_hashes)
    assert alloc.new_block_ids == [0, 1]
    assert len(m.pool.cached) == 1  # only block 0 is full after 5 tokens
    alloc = m.allocate_slots("a", 5, num_computed_tokens=5, block_hashes=a.hasher.block_hashes)
    assert alloc.new_block_ids == [2]
    alloc = m.allocate_slots("a", 4, num_computed_tokens=10, block_hashes=a.hasher.block_hashes)
    assert alloc.new_block_ids == [3]
    assert m.get_block_ids("a") == [0, 1, 2, 3]
    assert len(m.pool.cached) == 3


def test_free_is_idempotent_and_bad_calls_are_refused():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    assert m.free("unknown") == 0
    a = make_request("a", list(range(5)))
    schedule(m, a)
    with pytest.raises(ValueError):
        m.allocate_slots("a", -1)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.allocate_slots("a", 1, num_computed_tokens=9)
    match = m.get_computed_blocks(a.hasher.block_hashes, 5)
    with pytest.raises(ValueError, match="already holds blocks"):
        m.allocate_slots("a", 1, num_computed_tokens=5, prefix=match)
    assert m.free("a") == 2 and m.free("a") == 0
    assert m.num_free_blocks == 4
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)


def test_a_stale_prefix_match_is_refused():
    m = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    schedule(m, a)
    m.free("a")
    b = make_request("b", list(range(9)))
    match = m.get_computed_blocks(b.hasher.block_hashes, 9)
    assert match.num_cached_tokens == 8
    schedule(m, make_request("x", list(range(50, 62))))  # evicts a's blocks in between
    m.free("x")
    with pytest.raises(ValueError, match="stale prefix"):
        m.allocate_slots("b", 1, prefix=match, block_hashes=b.hasher.block_hashes)
    assert "b" not in m and m.num_free_blocks == 3


def test_block_table_slot_mapping():
    t = BlockTable(16, [7, 3, 12])
    assert t.slot(35) == 12 * 16 + 3
    assert t.slot_mapping(14, 18) == [7 * 16 + 14, 7 * 16 + 15, 3 * 16, 3 * 16 + 1]
    with pytest.raises(IndexError):
        t.slot_mapping(40, 49)
    with pytest.raises(IndexError):
        t.slot(-1)
