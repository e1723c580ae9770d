"""The content-addressed store: atomic puts, reuse by digest, re-validating loads, deletes."""

from __future__ import annotations

import os
import time

import pytest
import torch

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.store import AdapterStore
from tests.adapters.conftest import make_adapter, store_snapshot

ATTN = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.fixture
def adapter_dir(text_base, tmp_path):
    return make_adapter(text_base, tmp_path / "a", **ATTN)[0]


def files(adapter_dir):
    return (
        (adapter_dir / "adapter_config.json").read_bytes(),
        (adapter_dir / "adapter_model.safetensors").read_bytes(),
    )


def test_put_load_delete(adapter_dir, text_kw, tmp_path):
    store = AdapterStore(tmp_path / "store")
    assert store.digests() == []
    adapter = store.put_files(*files(adapter_dir), **text_kw)
    digest = adapter.digest
    assert store.has(digest) and store.digests() == [digest]
    assert sorted(os.listdir(store.root / digest)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (store.root / digest / "adapter_model.safetensors").read_bytes() == files(adapter_dir)[1]
    loaded = store.load(digest, **text_kw)
    assert loaded.digest == digest and set(loaded.weights) == set(adapter.weights)
    for key, (a, b, scale) in adapter.weights.items():
        a2, b2, scale2 = loaded.weights[key]
        assert torch.equal(a, a2) and torch.equal(b, b2) and scale == scale2
    assert store.delete(digest) and not store.has(digest) and store.digests() == []
    assert not store.delete(digest)
    with pytest.raises(KeyError):
        store.load(digest, **text_kw)
    assert store_snapshot(store) == []


def test_same_adapter_is_stored_once(adapter_dir, text_base, text_kw, tmp_path):
    store = AdapterStore(tmp_path / "store")
    first = store.put_dir(adapter_dir, **text_kw)
    again = make_adapter(text_base, tmp_path / "again", **ATTN)[0]  # same seed: same weights
    assert store.put_dir(again, **text_kw).digest == first.digest
    assert store.put_files(*files(adapter_dir), **text_kw).digest == first.digest
    other = make_adapter(text_base, tmp_path / "other", seed=5, **ATTN)[0]
    second = store.put_dir(other, **text_kw)
    assert store.digests() == sorted([first.digest, second.digest])
    assert not any(name.startswith(".tmp-") for name in os.listdir(store.root))


def test_bad_digests_never_touch_the_filesystem(adapter_dir, text_kw, tmp_path):
    store = AdapterStore(tmp_path / "store")
    store.put_dir(adapter_dir, **text_kw)
    for bad in ("../store", "", "A" * 64, "0" * 63, ".tmp-x", 42):
        assert not store.has(bad) and not store.delete(bad)
        with pytest.raises(KeyError):
            store.load(bad, **text_kw)
    assert len(store.digests()) == 1


def test_corrupted_stored_adapter_is_refused_on_load(adapter_dir, text_kw, tmp_path):
    store = AdapterStore(tmp_path / "store")
    digest = store.put_dir(adapter_dir, **text_kw).digest
    path = store.root / digest / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a weight's last byte: still a valid file, different content
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="corrupt"):
        store.load(digest, **text_kw)
    path.write_bytes(bytes(data[:-3]))
    with pytest.raises(AdapterError, match="truncated"):
        store.load(digest, **text_kw)


def test_failed_write_leaves_nothing(adapter_dir, text_kw, tmp_path, monkeypatch):
    store = AdapterStore(tmp_path / "store")
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        store.put_dir(adapter_dir, **text_kw)
    assert store_snapshot(store) == []
    monkeypatch.undo()
    assert store.has(store.put_dir(adapter_dir, **text_kw).digest)


def test_stale_temporaries_are_cleaned(adapter_dir, text_kw, tmp_path):
    root = tmp_path / "store"
    (root / ".tmp-old").mkdir(parents=True)
    (root / ".tmp-old" / "adapter_config.json").write_text("{}")
    os.utime(root / ".tmp-old", (time.time() - 7200, time.time() - 7200))
    (root / ".tmp-fresh").mkdir()  # a put in progress in another process
    store = AdapterStore(root)
    assert sorted(os.listdir(root)) == [".tmp-fresh"]
    assert store.digests() == []
