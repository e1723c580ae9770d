"""The adapter store in object storage (S3 through fsspec, against moto's S3 server): the
directory store's contract (puts reused by digest, re-validating loads, stash/unstash/purge),
a half-written adapter that does not count, and URLs that are refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.object_store import ObjectAdapterStore, open_store
from loraplex.adapters.store import AdapterStore
from tests.adapters.conftest import make_adapter
from tests.adapters.test_store import ATTN, files
from tests.s3_server import s3_server

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def bucket():
    mp = pytest.MonkeyPatch()
    with s3_server(mp) as url:
        yield url
    mp.undo()


@pytest.fixture
def store(bucket, request):
    return open_store(f"{bucket}/{request.node.name}")


@pytest.fixture
def adapter_dir(text_base, tmp_path):
    return make_adapter(text_base, tmp_path / "a", **ATTN)[0]


def test_open_store_picks_the_backend(bucket, tmp_path):
    assert isinstance(open_store(tmp_path / "dir"), AdapterStore)
    assert isinstance(open_store(str(tmp_path / "dir2")), AdapterStore)
    assert isinstance(open_store(f"{bucket}/x"), ObjectAdapterStore)
    with pytest.raises(ValueError, match="adapter store"):
        open_store("nosuchscheme://bucket/x")
    with pytest.raises(ValueError, match="no download cache"):
        open_store(tmp_path / "dir", cache_dir=tmp_path / "cache")


def test_put_load_stash_unstash_purge(store, adapter_dir, text_base, text_kw, tmp_path):
    assert store.digests() == []
    adapter = store.put_files(*files(adapter_dir), **text_kw)
    digest = adapter.digest
    assert store.has(digest) and store.digests() == [digest]
    assert (
        store.fs.cat_file(f"{store.root}/{digest}/adapter_model.safetensors")
        == files(adapter_dir)[1]
    )
    loaded = store.load(digest, **text_kw)
    for key, (a, b, scale) in adapter.weights.items():
        a2, b2, scale2 = loaded.weights[key]
        assert torch.equal(a, a2) and torch.equal(b, b2) and scale == scale2
    again = make_adapter(text_base, tmp_path / "again", **ATTN)[0]  # same weights: reused
    assert store.put_dir(again, **text_kw).digest == digest

    stashed = store.stash(digest)
    assert stashed is not None and not store.has(digest) and store.digests() == []
    with pytest.raises(KeyError):
        store.load(digest, **text_kw)
    store.unstash(stashed)
    assert store.has(digest) and store.load(digest, **text_kw).digest == digest
    stashed = store.stash(digest)
    store.purge(stashed)
    assert not store.has(digest) and store.stash(digest) is None and not store.delete(digest)
    store.fs.invalidate_cache()
    assert store.fs.find(store.root) == []  # no trash left


def test_a_stash_stored_again_meanwhile_is_dropped(store, adapter_dir, text_kw):
    digest = store.put_dir(adapter_dir, **text_kw).digest
    stashed = store.stash(digest)
    store.put_dir(adapter_dir, **text_kw)  # an upload stores it again (orphans protocol)
    store.unstash(stashed)
    assert store.digests() == [digest]
    store.fs.invalidate_cache()
    assert [p.rsplit("/", 2)[-2] for p in store.fs.find(store.root)] == [digest, digest]


def test_half_written_or_corrupt_adapters_are_never_served(store, adapter_dir, text_kw):
    config, weights = files(adapter_dir)
    digest = store.put_files(config, weights, **text_kw).digest
    other = "f" * 64
    store.fs.pipe_file(f"{store.root}/{other}/adapter_model.safetensors", weights)
    assert not store.has(other) and store.digests() == [digest]  # no config yet: not stored
    with pytest.raises(KeyError):
        store.load(other, **text_kw)
    data = bytearray(weights)
    data[-1] ^= 0x01
    store.fs.pipe_file(f"{store.root}/{digest}/adapter_model.safetensors", bytes(data))
    with pytest.raises(AdapterError, match="corrupt"):
        store.load(digest, **text_kw)
    for bad in ("../x", "", "A" * 64, ".trash-x", 42):
        assert not store.has(bad) and not store.delete(bad)
        with pytest.raises(KeyError):
            store.load(bad, **text_kw)


def test_downloads_are_cached_locally_by_digest_within_a_bound(
    bucket, request, adapter_dir, text_base, text_kw, tmp_path
):
    url = f"{bucket}/{request.node.name}"
    writer = open_store(url)
    first = writer.put_dir(adapter_dir, **text_kw).digest
    other_dir = make_adapter(text_base, tmp_path / "other", seed=5, **ATTN)[0]
    second = writer.put_dir(other_dir, **text_kw).digest
    one_size = sum(len(b) for b in files(adapter_dir))
    reader = ObjectAdapterStore(url, cache_dir=tmp_path / "cache", cache_bytes=one_size + 1000)
    for _ in range(3):
        assert reader.load(first, **text_kw).digest == first
    assert reader.downloads == 1 and reader.cache.digests() == [first]
    cached = reader.cache.root / first / "adapter_model.safetensors"
    data = bytearray(cached.read_bytes())
    data[-1] ^= 0x01  # a corrupt cache entry is dropped and fetched again
    cached.write_bytes(bytes(data))
    assert reader.load(first, **text_kw).digest == first and reader.downloads == 2
    assert reader.load(second, **text_kw).digest == second and reader.downloads == 3
    assert reader.cache.digests() == [second]  # the bound keeps the most recent one
    shared = ObjectAdapterStore(url, cache_dir=tmp_path / "cache")  # another core, same disk
    assert shared.load(second, **text_kw).digest == second and shared.downloads == 0


def test_a_cache_directory_others_may_enter_is_not_used(bucket, tmp_path, monkeypatch):
    import os

    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    monkeypatch.setattr(os, "geteuid", lambda: 12345)  # as if another user made it
    assert ObjectAdapterStore(f"{bucket}/x", cache_dir=open_dir).cache is None
    monkeypatch.undo()
    own = ObjectAdapterStore(f"{bucket}/x", cache_dir=tmp_path / "mine")
    assert own.cache is not None and (tmp_path / "mine").stat().st_mode & 0o777 == 0o700
