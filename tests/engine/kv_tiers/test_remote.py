"""The shared tier on a real ``redis-server`` (tests/redis_server.py): two replicas share records,
the namespace is bounded, corrupt records are dropped, other layouts and tenants stay apart;
and a Redis that is down never raises into the engine (that part needs no server)."""

import dataclasses
import socket
import time

import pytest
import torch

from loraplex.engine.kv_cache.tiers import HostTier, RedisTier, TieredStore, codec
from tests.engine.kv_tiers.conftest import block, keys
from tests.redis_server import redis_server


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def replicas(redis_url, layout, request):
    ns = f"test:{request.node.name}"
    made = [RedisTier(redis_url, layout, 1 << 20, namespace=ns) for _ in range(2)]
    yield made
    made[0].clear()
    for tier in made:
        tier.close()


@pytest.mark.service
def test_two_replicas_share_records(replicas, layout):
    a, b = replicas
    ks = keys(3)
    assert a.put(ks[0], block(layout, 0)) and a.put(ks[1], block(layout, 1))
    assert b.contains_many(ks) == [True, True, False]
    got = b.get_many(ks)
    assert torch.equal(got[0], block(layout, 0)) and torch.equal(got[1], block(layout, 1))
    assert got[2] is None
    assert b.put(ks[0], block(layout, 0))  # already there: not rewritten
    assert (a.stats.stores, b.stats.stores, b.stats.hits, b.stats.misses) == (2, 0, 2, 1)
    assert len(a) == 2 and a.used_bytes == 2 * codec.frame_nbytes(32, layout)


@pytest.mark.service
def test_the_namespace_is_bounded_least_recently_used_first(redis_url, layout, request):
    ns = f"test:{request.node.name}"
    cap = 3 * codec.frame_nbytes(32, layout)
    a, b = (RedisTier(redis_url, layout, cap, namespace=ns) for _ in range(2))
    ks = keys(5)
    for i in range(3):
        (a if i % 2 else b).put(ks[i], block(layout, i))
    time.sleep(0.002)
    assert b.get(ks[0]) is not None  # 1 is now the least recently used
    a.put(ks[3], block(layout, 3))
    assert a.contains_many(ks[:4]) == [True, False, True, True]
    b.put(ks[4], block(layout, 4))
    assert len(a) == 3 and a.used_bytes <= cap
    assert a.stats.evictions + b.stats.evictions == 2
    a.clear()
    assert len(a) == 0


@pytest.mark.service
def test_a_corrupt_record_is_deleted_not_served(replicas, layout):
    import redis

    a, b = replicas
    ks = keys(2)
    a.put(ks[0], block(layout, 0))
    a.put(ks[1], block(layout, 1))
    raw = redis.from_url(a.url)
    frame = bytearray(raw.get(a.record_key(ks[0])))
    frame[-3] ^= 0x40
    raw.set(a.record_key(ks[0]), bytes(frame))
    raw.set(a.record_key(ks[1]), raw.get(a.record_key(ks[1]))[:-10])  # truncated
    assert b.get_many(ks) == [None, None]
    assert b.stats.corrupt == 2 and raw.exists(a.record_key(ks[0])) == 0
    assert a.contains_many(ks) == [False, False]
    raw.close()


@pytest.mark.service
def test_layouts_and_tenants_are_apart_in_the_shared_tier(redis_url, layout):
    other = dataclasses.replace(layout, model="tiny@another-checkpoint")
    ours, theirs = RedisTier(redis_url, layout, 1 << 20), RedisTier(redis_url, other, 1 << 20)
    a_keys, b_keys = keys(2, salt="tenant-a"), keys(2, salt="tenant-b")
    for i, k in enumerate(a_keys):
        ours.put(k, block(layout, i))
    assert theirs.contains_many(a_keys) == [False, False] and theirs.get(a_keys[0]) is None
    assert ours.contains_many(b_keys) == [False, False] and ours.get_many(b_keys) == [None] * 2
    assert torch.equal(ours.get(a_keys[1]), block(layout, 1))
    ours.clear()
    theirs.clear()


@pytest.mark.service
def test_a_second_replica_loads_through_the_store_and_promotes(replicas, layout):
    a, b = replicas
    ks = keys(4)
    writer = TieredStore([HostTier(1 << 20), a], max_pending_bytes=1 << 20)
    for i, k in enumerate(ks[:3]):
        writer.offer(k, block(layout, i))
    assert writer.flush(5)
    host = HostTier(1 << 20)
    reader = TieredStore([host, b], max_pending_bytes=1 << 20)
    assert reader.lookup_prefix(ks) == 3
    loaded = reader.load_prefix(ks).result(5)
    assert [torch.equal(p, block(layout, i)) for i, p in enumerate(loaded)] == [True] * 3
    assert all(host.contains(k) for k in ks[:3])
    assert reader.stats()["tiers"]["remote"]["loaded_blocks"] == 3
    writer.close()
    reader.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_a_redis_that_is_down_never_raises(layout, caplog):
    url = f"redis://:hunter2@127.0.0.1:{closed_port()}/0"
    tier = RedisTier(url, layout, 1 << 20, retry_after_s=0.2)
    ks = keys(3)
    start = time.monotonic()
    assert tier.put(ks[0], block(layout, 0)) is False
    assert tier.contains(ks[0]) is False
    assert tier.get(ks[0]) is None
    assert tier.get_many(ks) == [None] * 3 and tier.contains_many(ks) == [False] * 3
    assert tier.used_bytes == 0 and len(tier) == 0
    assert time.monotonic() - start < 2
    assert tier.stats.errors >= 6 and tier.stats.misses == 4 and tier.stats.hits == 0
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "hunter2" not in warnings[0]  # logged once, no password
    host = HostTier(1 << 20)
    host.put(ks[0], block(layout, 0))
    store = TieredStore([host, tier], max_pending_bytes=1 << 20)
    assert store.offer(ks[1], block(layout, 1)) and store.flush(5)
    assert store.lookup_prefix(ks) == 2  # host has 0 and, written through, 1; remote is down
    assert len(store.load_prefix(ks).result(5)) == 2
    store.close()


def test_a_redis_that_does_not_answer_times_out(layout):
    with socket.socket() as listener:  # accepts connections, never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        tier = RedisTier(
            f"redis://127.0.0.1:{port}/0", layout, 1 << 20, timeout_s=0.1, retry_after_s=5
        )
        start = time.monotonic()
        assert tier.get(keys(1)[0]) is None  # one timeout, then short-circuited
        assert tier.put(keys(1)[0], block(layout, 0)) is False
        assert tier.contains_many(keys(2)) == [False, False]
        assert time.monotonic() - start < 1
        assert tier.stats.errors >= 3
        tier.close()


@pytest.mark.service
def test_a_stalled_redis_costs_one_timeout_then_the_tier_comes_back(redis_url, layout, request):
    import redis

    tier = RedisTier(
        redis_url,
        layout,
        1 << 20,
        namespace=f"test:{request.node.name}",
        timeout_s=0.1,
        retry_after_s=0.2,
    )
    k = keys(1)[0]
    assert tier.put(k, block(layout, 0))
    raw = redis.from_url(redis_url)
    raw.client_pause(400, all=True)  # the server stops answering every client for 0.4 s
    start = time.monotonic()
    assert tier.get(k) is None  # one timeout (0.1 s) ...
    assert tier.get(k) is None and tier.put(keys(2)[1], block(layout, 1)) is False  # ... then none
    assert time.monotonic() - start < 0.35
    assert tier.stats.errors == 3 and tier.stats.hits == 0
    time.sleep(0.6)
    assert torch.equal(tier.get(k), block(layout, 0))
    assert tier.stats.hits == 1
    tier.clear()
    tier.close()
    raw.close()
