"""The LoRA manager: CPU tier and device slots, LRU, never evicting a slot in use."""

from dataclasses import dataclass

import pytest
import torch

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.targets import lora_scale
from loraplex.engine.lora.slots import LoRAManager

SHAPES = {(0, "q_proj"): (8, 8), (0, "down_proj"): (12, 8), (1, "q_proj"): (8, 8)}


@dataclass(eq=False)
class FakeAdapter:
    digest: str
    rank: int
    weights: dict


def make(digest, rank, value, keys=((0, "q_proj"), (1, "q_proj"))):
    weights = {}
    for key in keys:
        fan_in, fan_out = SHAPES[key]
        weights[key] = (
            torch.full((rank, fan_in), value),
            torch.full((fan_out, rank), value),
            2.0 / rank,
        )
    return FakeAdapter(digest, rank, weights)


@pytest.fixture
def disk():
    return {f"d{i}": make(f"d{i}", rank=2 + i, value=float(i + 1)) for i in range(5)}


def manager(disk, loads, max_loras=2, max_cpu=3):
    def loader(digest):
        loads.append(digest)
        return disk[digest]

    return LoRAManager(
        SHAPES,
        max_loras=max_loras,
        max_cpu_loras=max_cpu,
        max_rank=8,
        device=torch.device("cpu"),
        dtype=torch.float32,
        loader=loader,
    )


def test_slots_hold_padded_weights_and_scales(disk):
    loads = []
    m = manager(disk, loads)
    slot = m.acquire("d1")  # rank 3
    buf = m.buffers[(0, "q_proj")]
    assert buf.ranks[slot] == 3 and buf.scales[slot] == pytest.approx(2.0 / 3)
    assert torch.all(buf.lora_a[slot, :3] == 2.0) and torch.all(buf.lora_a[slot, 3:] == 0)
    assert torch.all(buf.lora_b[slot, :, :3] == 2.0) and torch.all(buf.lora_b[slot, :, 3:] == 0)
    untouched = m.buffers[(0, "down_proj")]
    assert untouched.ranks[slot] == 0 and untouched.scales[slot] == 0
    assert loads == ["d1"]
    a_t, b_t, scale = buf.views[slot]  # the per-slot path's operands: views of the buffers
    assert a_t.shape == (8, 3) and b_t.shape == (3, 8) and scale == pytest.approx(2.0 / 3)
    assert a_t.data_ptr() == buf.lora_a[slot].data_ptr() and untouched.views[slot] is None


def test_a_reused_slot_gets_the_new_adapters_views(disk):
    m = manager(disk, [], max_loras=1)
    slot = m.acquire("d1")  # rank 3
    m.release("d1")
    assert m.acquire("d3") == slot  # rank 5, evicts d1 from the one slot
    buf = m.buffers[(0, "q_proj")]
    a_t, b_t, scale = buf.views[slot]
    assert a_t.shape == (8, 5) and b_t.shape == (5, 8) and scale == pytest.approx(2.0 / 5)
    assert torch.all(a_t == 4.0) and torch.all(b_t == 4.0)
    assert m.remove("d3") is False  # in use
    m.release("d3")
    assert m.remove("d3") and buf.views[slot] is None


def test_lru_eviction_never_takes_a_slot_in_use(disk):
    loads = []
    m = manager(disk, loads)
    s0 = m.acquire("d0")
    s1 = m.acquire("d1")
    assert {s0, s1} == {0, 1}
    assert m.acquire("d2") is None  # both held by running sequences
    m.release("d0")
    s2 = m.acquire("d2")  # evicts d0 (unused), not d1
    assert s2 == s0 and m.slot_of("d0") is None and m.slot_of("d1") == s1
    m.release("d1")
    m.release("d2")
    m.acquire("d1")  # touch d1: now d2 is the least recently used
    m.release("d1")
    m.acquire("d3")
    assert m.slot_of("d2") is None and m.slot_of("d1") is not None
    assert m.slots_in_use == 1


def test_cpu_tier_is_lru_and_reloads_from_the_loader(disk):
    loads = []
    m = manager(disk, loads, max_loras=1, max_cpu=2)
    for d in ("d0", "d1", "d2"):
        m.acquire(d)
        m.release(d)
    assert m.cpu_digests == ["d1", "d2"] and loads == ["d0", "d1", "d2"]
    m.acquire("d0")  # evicted from the CPU tier: read again
    assert loads[-1] == "d0"


def test_remove_refused_while_in_use_and_unknown_digest(disk):
    m = manager(disk, [])
    m.acquire("d0")
    assert m.remove("d0") is False
    m.release("d0")
    assert m.remove("d0") is True and m.slot_of("d0") is None
    with pytest.raises(AdapterError, match="unknown adapter"):
        m.acquire("nope")
    assert m.slots_in_use == 0 and m.acquire("d1") is not None  # the failed load freed its slot


def test_rank_over_the_limit_and_bad_sizes(disk):
    disk["big"] = make("big", rank=9, value=1.0)
    m = manager(disk, [])
    with pytest.raises(AdapterError, match="rank"):
        m.acquire("big")
    with pytest.raises(ValueError):
        LoRAManager(
            SHAPES,
            max_loras=3,
            max_cpu_loras=2,
            max_rank=8,
            device=torch.device("cpu"),
            dtype=torch.float32,
            loader=disk.get,
        )
    assert lora_scale(16, 4, False) == 4.0 and lora_scale(16, 4, True) == 8.0
