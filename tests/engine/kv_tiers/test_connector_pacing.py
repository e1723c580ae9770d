"""The KV tier connector's paced loads: a load always makes progress while other requests run.

A real ``KVCacheManager``, CPU pool tensors and a ``TieredStore`` with a host tier; the request
is a real ``Sequence``. No engine: ``poll`` is called as the engine calls it between steps.
"""

import time

import torch

from loraplex.engine.core.kv_tiers import LOAD_CREDIT_CAP_S, LOAD_MIN_CHUNK, KVTierConnector
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_cache.tiers import HostTier, TieredStore
from loraplex.engine.request import EngineRequest
from loraplex.engine.runner.kv_transfer import gather_blocks
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sequence import Sequence

BS = 4
NUM_BLOCKS = 64


def _caches(seed):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BS, 1, 8)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(2)]


def _seq(rid, tokens):
    request = EngineRequest(rid, list(tokens), SamplingParams())
    return Sequence(rid, request, 0, list(tokens), request.block_hasher(BS))


def test_a_load_after_a_slow_chunk_still_finishes_while_others_run():
    # The tier holds the 20 leading blocks of the prompt (written from another pool).
    tokens = list(range(20 * BS + 1))
    source = _caches(seed=1)
    host = HostTier(1 << 20)
    seq = _seq("r", tokens)
    for i, (h, payload) in enumerate(
        zip(seq.hasher.block_hashes, gather_blocks(source, range(20)), strict=True)
    ):
        assert host.put(h, payload), i
    store = TieredStore([host], max_pending_bytes=1 << 20)
    kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS)
    conn = KVTierConnector(store, kv, _caches(seed=2))
    try:
        assert conn.start_load(seq)
        # An earlier chunk took 20 ms a block (a remote tier's pause, a cold disk): more than
        # the credit cap pays for LOAD_MIN_CHUNK blocks at once.
        conn._block_seconds = 0.02
        assert LOAD_CREDIT_CAP_S / conn._block_seconds < LOAD_MIN_CHUNK
        queued = []
        for _ in range(200):  # other requests run: every poll gets a 5 ms budget
            conn.poll(queued.append, budget_s=0.005)
            if queued:
                break
        assert queued == [seq], "the load never finished while other requests ran"
        assert kv.num_pinned == 0
        match = kv.get_computed_blocks(seq.hasher.block_hashes, len(tokens))
        assert match.num_cached_tokens == 20 * BS
        got = gather_blocks(conn.kv_caches, [b.block_id for b in match.blocks])
        want = gather_blocks(source, range(20))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        conn.close()


def test_a_load_never_evicts_its_own_pool_prefix():
    # Pool of 8: the prompt's first 2 blocks cached and free, another request holding 4, so
    # 2 blocks were never used; the tier holds the prompt's blocks 2..4 (3 blocks to load).
    tokens = list(range(5 * BS + 1))
    seq = _seq("r", tokens)
    hashes = seq.hasher.block_hashes
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.allocate_slots("a", 2 * BS, block_hashes=hashes[:2])
    kv.free("a")
    other = _seq("b", range(1000, 1000 + 4 * BS)).hasher.block_hashes
    kv.allocate_slots("b", 4 * BS, block_hashes=other)
    host = HostTier(1 << 20)
    for h, payload in zip(hashes[2:5], gather_blocks(_caches(seed=1), range(3)), strict=True):
        host.put(h, payload)
    conn = KVTierConnector(TieredStore([host], max_pending_bytes=1 << 20), kv, _caches(seed=2))
    try:
        assert conn.start_load(seq)
        queued = []
        conn.poll(queued.append, budget_s=None)
        assert queued == [seq] and kv.num_pinned == 0
        cached = [h in kv.pool.cached for h in hashes[:5]]
        assert cached[:2] == [True, True], "the load evicted the pool prefix it continues"
        # Never a block cached behind a missing one (a load that no lookup can reach).
        assert cached == sorted(cached, reverse=True)
    finally:
        conn.close()


def test_loads_take_turns_so_a_long_one_does_not_hold_a_short_one_back():
    # Two requests' prefixes in the tier: a long one (24 blocks) first, a short one (2) after.
    source = _caches(seed=3)
    host = HostTier(1 << 22)
    long_seq = _seq("long", list(range(24 * BS + 1)))
    short_seq = _seq("short", list(range(5000, 5000 + 2 * BS + 1)))
    for seq, blocks in ((long_seq, range(24)), (short_seq, range(24, 26))):
        for h, payload in zip(seq.hasher.block_hashes, gather_blocks(source, blocks), strict=True):
            assert host.put(h, payload)
    store = TieredStore([host], max_pending_bytes=1 << 20)
    kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BS)
    conn = KVTierConnector(store, kv, _caches(seed=4))
    try:
        assert conn.start_load(long_seq) and conn.start_load(short_seq)
        read = store.read_prefix

        def slow_read(keys):  # a tier at 1 ms a block: a chunk of 8 costs 8 ms of credit
            time.sleep(1e-3 * len(keys))
            return read(keys)

        store.read_prefix = slow_read
        queued = []
        for _ in range(400):  # other requests run: a 4 ms budget a poll
            conn.poll(queued.append, budget_s=0.004)
            if len(queued) == 2:
                break
        assert queued == [short_seq, long_seq]  # the short load did not wait for the long one
        assert conn.stats.loaded_blocks == 26 and conn.stats.loads_fallen_back == 0
        assert kv.num_pinned == 0
    finally:
        conn.close()
