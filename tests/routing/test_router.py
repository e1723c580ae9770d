"""The router's replica views (from KV events) and its choice: cache hits, adapter residency,
load, the imbalance fallback, health, and the two baselines."""

import pytest

from loraplex.engine.client.replica_view import ReplicaView
from loraplex.engine.client.router import NoReplicaError, Router, RoutingPolicy
from loraplex.engine.kv_cache.events import KVEvent, KVEventLog

H = [bytes([i]) * 4 for i in range(10)]


def stored(*hashes):
    return KVEvent("stored", list(hashes))


def test_view_mirrors_the_events_in_order():
    view = ReplicaView("a")
    view.apply([stored(H[0], H[1], H[2]), KVEvent("removed", [H[1]])])
    assert view.leading_hits(H[:3]) == 1  # a prefix match stops at the first miss
    view.apply([KVEvent("lora_loaded", adapter="d1"), KVEvent("lora_loaded", adapter="d2")])
    view.apply([KVEvent("lora_unloaded", adapter="d1"), KVEvent("cleared")])
    assert view.hashes == set() and view.adapters == {"d2"}
    view.apply([stored(H[0])])
    view.reset()
    assert not view.hashes and not view.adapters


def test_event_log_drains_in_order_and_bounds_what_it_holds():
    log = KVEventLog(max_pending=4)
    assert [e.kind for e in log.drain()] == ["cleared"]  # a fresh engine holds nothing
    log.stored([H[0], H[1]])
    log.stored([])  # nothing: not recorded
    log.adapter_loaded("d")
    log.removed([H[0]])
    assert [(e.kind, e.block_hashes, e.adapter) for e in log.drain()] == [
        ("stored", [H[0], H[1]], None),
        ("lora_loaded", [], "d"),
        ("removed", [H[0]], None),
    ]
    assert log.drain() == []
    log.adapter_loaded("d")
    log.stored(H[:3])
    log.stored(H[3:5])  # past 4 pending hashes: dropped, one cleared instead
    assert [e.kind for e in log.drain()] == ["lora_loaded", "cleared"]
    assert log.num_overflows == 1


def router(**kw):
    return Router(["a", "b", "c"], RoutingPolicy(block_size=16, **kw))


def test_the_replica_holding_the_longest_prefix_wins():
    r = router()
    r.views["b"].apply([stored(*H[:3])])
    r.views["c"].apply([stored(*H[:5])])
    assert r.choose(H[:6]) == "c"
    assert r.choose(H[:3]) in ("b", "c")
    assert r.choose([H[9]]) == "a"  # no hit anywhere: the least loaded, then the first


def test_adapter_residency_and_load_are_weighed_in_tokens():
    r = router(adapter_load_tokens=256)
    r.views["a"].apply([stored(*H[:4])])  # saves 64 tokens of prefill
    r.views["b"].apply([KVEvent("lora_loaded", adapter="d")])  # saves an adapter load
    assert r.choose(H[:4], adapter="d") == "b"
    assert r.choose(H[:4], adapter=None) == "a"
    r.started("b", 2000)  # b's queue (an eighth of its tokens) outweighs its adapter
    assert r.choose(H[:4], adapter="d") == "a"
    r.finished("b", 2000)
    assert r.views["b"].outstanding_tokens == 0
    assert r.choose(H[:4], adapter="d") == "b"


def test_past_the_imbalance_threshold_the_least_loaded_replica_wins():
    r = router(imbalance_tokens=1000, imbalance_ratio=2.0, load_weight=0.0)
    r.views["a"].apply([stored(*H)])
    r.started("a", 900)
    assert r.choose(H) == "a"  # within the threshold: the cache wins
    r.started("a", 200)
    r.started("b", 10)
    assert r.choose(H) == "c"  # 1,100 queued vs 0: least loaded


def test_unhealthy_replicas_are_skipped_and_rejoin_empty():
    r = router()
    r.views["a"].apply([stored(*H)])
    r.set_healthy("a", False)
    assert r.choose(H) in ("b", "c")
    r.set_healthy("a", True)
    assert r.views["a"].hashes == set()
    for name in "abc":
        r.set_healthy(name, False)
    with pytest.raises(NoReplicaError):
        r.choose(H)


def test_baselines():
    rr = router(policy="round_robin")
    assert [rr.choose(H) for _ in range(4)] == ["a", "b", "c", "a"]
    ll = router(policy="least_loaded")
    ll.views["a"].apply([stored(*H)])
    ll.started("a", 5)
    assert ll.choose(H) == "b"
    with pytest.raises(ValueError):
        RoutingPolicy(policy="random")
    with pytest.raises(ValueError):
        Router(["a", "a"])


def test_tier_resident_prefixes_count_at_the_tier_weight():
    from loraplex.engine.client.replicas import tier_capacity_blocks

    r = router(tier_weight=0.5)
    for name in "abc":
        r.views[name].tier_capacity_blocks = 3
    # b computed 4 blocks, then its pool evicted them: its own tiers keep the last 3 stored.
    r.views["b"].apply([stored(*H[:4]), KVEvent("removed", H[:4])])
    assert r.views["b"].leading_tier_hits(H[:4]) == (0, 0)  # H[0] fell out of the bound
    assert r.views["b"].leading_tier_hits(H[1:4]) == (0, 3)
    r.views["b"].apply([stored(H[0])])  # recomputed: in the pool and its tiers again
    assert r.views["b"].leading_tier_hits(H[:4]) == (1, 0)  # H[1] fell out now
    r.views["b"].tier_hashes.clear()
    r.views["b"].apply([stored(*H[:3]), KVEvent("removed", H[:3])])
    assert r.views["b"].leading_tier_hits(H[:4]) == (0, 3)
    # c holds 2 in its pool: 2 pool blocks (32 tokens) beat 3 tier blocks at 0.5 (24).
    r.views["c"].apply([stored(*H[:2])])
    assert r.choose(H[:4]) == "c"
    # At weight 1, b's 3 tier blocks beat c's 2 pool blocks.
    r2 = router(tier_weight=1.0)
    for name in "bc":
        r2.views[name].tier_capacity_blocks = 3
    r2.views["b"].apply([stored(*H[:3]), KVEvent("removed", H[:3])])
    r2.views["c"].apply([stored(*H[:2])])
    assert r2.choose(H[:4]) == "b"
    # A replica without tiers forgets what its pool evicted.
    r3 = router()
    r3.views["a"].tier_capacity_blocks = 0
    r3.views["a"].apply([stored(*H[:3]), KVEvent("removed", H[:3])])
    assert r3.views["a"].leading_tier_hits(H[:3]) == (0, 0)
    assert (
        tier_capacity_blocks(
            {"kv_blocks_total": 10, "kv_cache_bytes": 1000, "kv_tier_host_capacity_bytes": 500}
        )
        == 5
    )
    assert tier_capacity_blocks({"kv_blocks_total": 10, "kv_cache_bytes": 1000}) == 0
