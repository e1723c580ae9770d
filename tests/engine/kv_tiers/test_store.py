"""The tiered store: write-through offers off the caller's thread, prefix lookups and loads
that stop at the first miss, promotion into host memory, the pending-bytes bound, and keys of
different tenants and adapters kept apart in every tier."""

import threading

import pytest
import torch

from loraplex.engine.kv_cache.tiers import DiskTier, HostTier, TieredStore, codec
from tests.engine.kv_tiers.conftest import block, keys


def record(layout):
    return codec.frame_nbytes(32, layout)


@pytest.fixture
def tiers(tmp_path, layout):
    host = HostTier(16 * layout.block_nbytes)
    disk = DiskTier(tmp_path, 64 * record(layout), layout)
    return host, disk


@pytest.fixture
def store(tiers):
    s = TieredStore(list(tiers), max_pending_bytes=1 << 20)
    yield s
    s.close()


def test_offers_are_written_through_to_every_tier(store, tiers, layout):
    host, disk = tiers
    ks = keys(4)
    for i, k in enumerate(ks):
        assert store.offer(k, block(layout, i))
    assert store.flush(5)
    assert all(host.contains(k) and disk.contains(k) for k in ks)
    assert torch.equal(disk.get(ks[2]), block(layout, 2))
    # Offered again: every tier has it, nothing is rewritten.
    store.offer(ks[0], block(layout, 0))
    assert store.flush(5)
    stats = store.stats()
    assert stats["store"]["written"] == 8 and stats["store"]["offered"] == 5
    assert stats["tiers"]["host"]["stores"] == 4 and stats["tiers"]["disk"]["stores"] == 4
    assert stats["store"]["pending_bytes"] == 0


def test_lookup_prefix_counts_leading_blocks_held_by_any_tier(store, tiers, layout):
    host, disk = tiers
    ks = keys(6)
    host.put(ks[0], block(layout, 0))
    disk.put(ks[1], block(layout, 1))
    host.put(ks[2], block(layout, 2))
    disk.put(ks[2], block(layout, 2))
    host.put(ks[4], block(layout, 4))  # after the gap at 3: not part of the prefix
    assert store.lookup_prefix(ks) == 3
    assert store.lookup_prefix(ks[3:]) == 0
    assert store.lookup_prefix([]) == 0
    assert store.lookup_prefix(ks[:2]) == 2


def test_load_prefix_stops_at_the_first_miss_and_promotes_disk_hits(store, tiers, layout):
    host, disk = tiers
    ks = keys(5)
    host.put(ks[0], block(layout, 0))
    disk.put(ks[1], block(layout, 1))
    disk.put(ks[2], block(layout, 2))
    disk.put(ks[4], block(layout, 4))
    loaded = store.load_prefix(ks).result(5)
    assert len(loaded) == 3
    for i, payload in enumerate(loaded):
        assert torch.equal(payload, block(layout, i))
    assert host.contains(ks[1]) and host.contains(ks[2]) and not host.contains(ks[4])
    stats = store.stats()
    assert stats["tiers"]["host"]["loaded_blocks"] == 1
    assert stats["tiers"]["disk"]["loaded_blocks"] == 2
    assert stats["tiers"]["disk"]["loaded_bytes"] == 2 * layout.block_nbytes
    assert stats["tiers"]["disk"]["load_seconds"] > 0
    assert stats["store"]["promotions"] == 2
    assert store.load_prefix(ks[3:]).result(5) == []


def test_a_corrupt_record_falls_through_to_the_next_tier_or_ends_the_prefix(tmp_path, layout):
    ks = keys(3)
    disk = DiskTier(tmp_path / "a", 64 * record(layout), layout)
    backup = DiskTier(tmp_path / "b", 64 * record(layout), layout, name="disk2")
    for i, k in enumerate(ks):
        disk.put(k, block(layout, i))
    backup.put(ks[0], block(layout, 0))
    for k in ks[:2]:
        data = bytearray(disk.path(k).read_bytes())
        data[-1] ^= 0xFF
        disk.path(k).write_bytes(bytes(data))
    store = TieredStore([disk, backup], max_pending_bytes=0)
    loaded = store.load_prefix(ks).result(5)
    assert len(loaded) == 1 and torch.equal(loaded[0], block(layout, 0))  # 1 is bad everywhere
    assert disk.stats.corrupt == 2 and store.stats()["tiers"]["disk2"]["loaded_blocks"] == 1
    store.close()


class GatedHost(HostTier):
    """A host tier whose puts wait for a gate: the writer thread stuck on a slow tier."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, key, payload):
        self.entered.set()
        assert self.gate.wait(10)
        return super().put(key, payload)


def test_offers_beyond_the_pending_bound_are_dropped_not_blocking(layout):
    tier = GatedHost(64 * layout.block_nbytes)
    store = TieredStore([tier], max_pending_bytes=2 * layout.block_nbytes)
    ks = keys(5)
    assert store.offer(ks[0], block(layout, 0))
    assert tier.entered.wait(5)  # the writer holds block 0 and waits on the tier
    assert store.offer(ks[1], block(layout, 1))
    assert not store.offer(ks[2], block(layout, 2))  # 3 blocks pending > 2: dropped at once
    assert store.offer(ks[1], block(layout, 1))  # already queued: not counted twice
    assert store.stats()["store"]["dropped"] == 1
    assert not store.flush(0.05)
    tier.gate.set()
    assert store.flush(5)
    assert [tier.contains(k) for k in ks[:3]] == [True, True, False]
    assert store.offer(ks[3], block(layout, 3)) and store.flush(5)
    store.close()
    assert not store.offer(ks[4], block(layout, 4))  # closed: dropped
    assert store.load_prefix(ks).result(1) == []


def test_tenants_and_adapters_never_load_each_others_blocks(store, tiers, layout):
    host, disk = tiers
    same_tokens = {
        "tenant-a": keys(3, salt="tenant-a"),
        "tenant-b": keys(3, salt="tenant-b"),
        "adapter-x": keys(3, lora="x" * 64),
        "base": keys(3),
    }
    flat = [k for ks in same_tokens.values() for k in ks]
    assert len(set(flat)) == len(flat)  # twelve distinct records
    for i, k in enumerate(same_tokens["tenant-a"]):
        store.offer(k, block(layout, i))
    assert store.flush(5)
    for name in ("tenant-b", "adapter-x", "base"):
        assert store.lookup_prefix(same_tokens[name]) == 0
        assert store.load_prefix(same_tokens[name]).result(5) == []
    host.close()  # only disk now: still isolated, and tenant A still gets its own blocks
    assert store.load_prefix(same_tokens["tenant-b"]).result(5) == []
    got = store.load_prefix(same_tokens["tenant-a"]).result(5)
    assert [torch.equal(g, block(layout, i)) for i, g in enumerate(got)] == [True] * 3


def test_tier_names_must_be_unique(layout):
    with pytest.raises(ValueError):
        TieredStore([HostTier(1), HostTier(1)], max_pending_bytes=0)


def test_concurrent_offers_loads_and_evictions_stay_consistent(tmp_path, layout):
    host = HostTier(6 * layout.block_nbytes)
    disk = DiskTier(tmp_path, 10 * record(layout), layout)
    store = TieredStore([host, disk], max_pending_bytes=8 * layout.block_nbytes)
    ks = keys(24)
    payloads = [block(layout, i) for i in range(24)]
    wrong = []

    def offer(start):
        for i in range(start, 24, 2):
            store.offer(ks[i], payloads[i])

    def load():
        for n in range(40):
            got = store.load_prefix(ks[n % 8 :]).result(5)
            for j, p in enumerate(got):
                if not torch.equal(p, payloads[n % 8 + j]):
                    wrong.append(n % 8 + j)

    threads = [threading.Thread(target=offer, args=(s,)) for s in (0, 1)]
    threads += [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.flush(10)
    assert wrong == []
    assert host.used_bytes <= host.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
    on_disk = {p.name for p in (tmp_path / layout.fingerprint()).glob("*/*.kv")}
    assert on_disk == {k.hex() + ".kv" for k in ks if disk.contains(k)}
    assert (
        len(on_disk) == len(disk)
        and sum(p.numel() for p in [host.get(k) for k in ks if host.contains(k)]) == host.used_bytes
    )
    store.close()
