"""The host-memory and local-disk tiers: byte bounds, LRU, persistence across restarts, and
records that are corrupt, truncated or of another layout never served."""

import dataclasses
import json
import os
import threading

import pytest
import torch

from loraplex.engine.kv_cache.tiers import DiskTier, HostTier, codec
from tests.engine.kv_tiers.conftest import block, keys


def test_host_lru_is_bounded_in_bytes_and_get_refreshes(layout):
    size = layout.block_nbytes
    tier = HostTier(3 * size)
    ks = keys(5)
    for i in range(3):
        assert tier.put(ks[i], block(layout, i))
    assert tier.get(ks[0]) is not None  # 0 becomes the most recent: 1 is the oldest
    assert tier.put(ks[3], block(layout, 3))
    assert [tier.contains(k) for k in ks[:4]] == [True, False, True, True]
    assert tier.used_bytes == 3 * size and len(tier) == 3
    assert tier.put(ks[4], block(layout, 4))
    assert [tier.contains(k) for k in ks[:5]] == [True, False, False, True, True]
    assert torch.equal(tier.get(ks[4]), block(layout, 4))
    assert tier.get(ks[1]) is None
    s = tier.stats
    assert (s.stores, s.evictions, s.hits, s.misses) == (5, 2, 2, 1)
    assert s.bytes_written == 5 * size and s.bytes_read == 2 * size


def test_host_refuses_a_block_larger_than_its_capacity(layout):
    tier = HostTier(layout.block_nbytes - 1)
    assert not tier.put(keys(1)[0], block(layout, 0))
    assert tier.used_bytes == 0 and tier.stats.rejected == 1
    with pytest.raises(ValueError):
        tier.put(keys(1)[0], torch.zeros(4, dtype=torch.float32))


def record_nbytes(layout):
    return codec.frame_nbytes(32, layout)


def test_disk_round_trip_layout_json_and_byte_bound(tmp_path, layout):
    tier = DiskTier(tmp_path, 3 * record_nbytes(layout), layout)
    ks = keys(4)
    for i, k in enumerate(ks):
        assert tier.put(k, block(layout, i))
    assert tier.used_bytes == 3 * record_nbytes(layout) <= tier.capacity_bytes
    assert not tier.contains(ks[0]) and not tier.path(ks[0]).exists()
    assert torch.equal(tier.get(ks[3]), block(layout, 3))
    directory = tmp_path / layout.fingerprint()
    assert json.loads((directory / "layout.json").read_text())["head_dim"] == layout.head_dim
    files = sorted(p.name for p in directory.glob("*/*.kv"))
    assert files == sorted(k.hex() + ".kv" for k in ks[1:])
    assert tier.stats.evictions == 1


def test_disk_records_survive_a_restart_in_lru_order(tmp_path, layout):
    ks = keys(4)
    first = DiskTier(tmp_path, 10 * record_nbytes(layout), layout)
    for i, k in enumerate(ks):
        first.put(k, block(layout, i))
    for k in (ks[0], ks[2]):  # accessed after the others
        assert first.get(k) is not None
    first.close()
    again = DiskTier(tmp_path, 10 * record_nbytes(layout), layout)
    assert len(again) == 4 and again.used_bytes == 4 * record_nbytes(layout)
    for i, k in enumerate(ks):
        assert torch.equal(again.get(k), block(layout, i))
    again.close()
    # A smaller capacity on open evicts the least recently used: 1 and 3, then 0.
    os.utime(again.path(ks[1]), ns=(1, 1_000))
    os.utime(again.path(ks[3]), ns=(1, 2_000))
    os.utime(again.path(ks[0]), ns=(1, 3_000))
    small = DiskTier(tmp_path, record_nbytes(layout), layout)
    assert [small.contains(k) for k in ks] == [False, False, True, False]
    assert small.stats.evictions == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "grow"])
def test_disk_never_serves_a_damaged_record(tmp_path, layout, damage):
    tier = DiskTier(tmp_path, 10 * record_nbytes(layout), layout)
    ks = keys(2)
    tier.put(ks[0], block(layout, 0))
    tier.put(ks[1], block(layout, 1))
    path = tier.path(ks[0])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = b""
    else:
        data += b"x"
    path.write_bytes(bytes(data))
    assert tier.get(ks[0]) is None
    assert not path.exists() and not tier.contains(ks[0])
    assert tier.stats.corrupt == 1 and tier.used_bytes == record_nbytes(layout)
    assert torch.equal(tier.get(ks[1]), block(layout, 1))  # the others are intact
    # ... and across a restart it is simply gone.
    assert not DiskTier(tmp_path, 10 * record_nbytes(layout), layout).contains(ks[0])


def test_another_layouts_directory_is_never_read_or_evicted(tmp_path, layout):
    other = dataclasses.replace(layout, model="tiny@another-checkpoint")
    ks = keys(3)
    theirs = DiskTier(tmp_path, 10 * record_nbytes(other), other)
    for i, k in enumerate(ks):
        theirs.put(k, block(other, 100 + i))
    ours = DiskTier(tmp_path, record_nbytes(layout), layout)
    assert not any(ours.contains(k) for k in ks) and ours.get(ks[0]) is None
    # Their record copied into our directory under the same name: same key, wrong fingerprint.
    ours.path(ks[0]).parent.mkdir(parents=True, exist_ok=True)
    ours.path(ks[0]).write_bytes(theirs.path(ks[0]).read_bytes())
    reopened = DiskTier(tmp_path, record_nbytes(layout), layout)
    assert reopened.contains(ks[0])
    assert reopened.get(ks[0]) is None and reopened.stats.corrupt == 1
    for i, k in enumerate(ks[1:], 1):  # our writes evict ours, never theirs
        assert reopened.put(k, block(layout, i))
    assert all(theirs.path(k).exists() for k in ks)
    assert all(torch.equal(theirs.get(k), block(other, 100 + i)) for i, k in enumerate(ks))


def test_stray_temp_files_of_a_dead_writer_are_cleaned_on_open(tmp_path, layout):
    tier = DiskTier(tmp_path, 10 * record_nbytes(layout), layout)
    k = keys(1)[0]
    tier.put(k, block(layout, 0))
    sub = tier.path(k).parent
    dead = sub / f"{k.hex()}.kv.999999999-deadbeef.tmp"  # no such pid
    stale_self = sub / f"{k.hex()}.kv.{os.getpid()}-notlive.tmp"  # ours, no open tier's
    live = sub / f"{k.hex()}.kv.{tier._token}.tmp"  # a write in flight of an open tier
    for p in (dead, stale_self, live):
        p.write_bytes(b"partial")
    again = DiskTier(tmp_path, 10 * record_nbytes(layout), layout)
    assert not dead.exists() and not stale_self.exists() and live.exists()
    assert len(again) == 1 and again.used_bytes == record_nbytes(layout)


def test_the_wrong_payload_length_is_refused(tmp_path, layout):
    tier = DiskTier(tmp_path, 10 * record_nbytes(layout), layout)
    with pytest.raises(ValueError):
        tier.put(keys(1)[0], block(layout, 0)[:-4])
    assert tier.put(keys(1)[0], block(layout, 0)) and tier.contains(keys(1)[0])
    small = DiskTier(tmp_path / "small", record_nbytes(layout) - 1, layout)
    assert not small.put(keys(1)[0], block(layout, 0)) and small.stats.rejected == 1


@pytest.mark.parametrize("plant", ["fifo", "symlink"])
def test_a_fifo_or_link_in_place_of_a_record_is_dropped_without_blocking(tmp_path, layout, plant):
    tier = DiskTier(tmp_path, 1 << 20, layout)
    (k,) = keys(1)
    assert tier.put(k, block(layout, 0))
    path = tier.path(k)
    os.unlink(path)
    if plant == "fifo":
        os.mkfifo(path)  # open(..., "rb") would wait for a writer forever: the engine thread
    else:
        other = tmp_path / "elsewhere.kv"
        other.write_bytes(b"x" * codec.frame_nbytes(len(k), layout))
        os.symlink(other, path)
    got = []
    reader = threading.Thread(target=lambda: got.append(tier.get(k)), daemon=True)
    reader.start()
    reader.join(timeout=2)
    if reader.is_alive():  # release the blocked reader before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=2)
        pytest.fail("get() blocked on a FIFO planted in the tier's directory")
    assert got == [None] and not tier.contains(k) and not os.path.lexists(path)
