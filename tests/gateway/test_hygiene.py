"""Issue 13's hygiene items: adapter names ``.``/``..``, private files, orphaned weights collected
at start-up without ever losing a referenced blob, and admin limits that fit their column."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from loraplex.gateway.auth.secrets_store import load_or_create_admin_key
from loraplex.gateway.db.session import db_url, make_engine, session_factory
from loraplex.gateway.domains.adapters import service as adapter_service
from loraplex.gateway.domains.adapters.orphans import remove_if_unused
from loraplex.gateway.services.adapters import AdapterFacts, create_adapter
from loraplex.gateway.services.tenants import MAX_LIMIT
from tests.adapters.conftest import make_adapter
from tests.gateway.live import LiveGateway
from tests.gateway.test_adapters_api import GOOD, OTHER, read, upload_dir
from tests.gateway.test_app_basics import assert_openai_error

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(hf_llava, tmp_path_factory):
    root = tmp_path_factory.mktemp("hygiene")
    good = make_adapter(hf_llava, root / "good", seed=11, **GOOD)[0]
    other = make_adapter(hf_llava, root / "other", seed=12, **OTHER)[0]
    third = make_adapter(hf_llava, root / "third", seed=13, **GOOD)[0]
    return good, other, third


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ------------------------------------------------------------------------------- names
@pytest.mark.parametrize("name", [".", ".."])
def test_dot_names_are_refused(live, adapters, name):
    t = live.create_tenant("acme")
    with live.client(t["api_key"]) as c:
        err = assert_openai_error(upload_dir(c, name, adapters[0]), 400)
        assert err["param"] == "name" and repr(name) in err["message"]
        assert upload_dir(c, "...", adapters[0]).status_code == 201  # only the two are special


# ------------------------------------------------------------------------------- modes
@pytest.fixture
def open_umask():
    """Umask 0: any file or directory left to the umask would be world-readable."""
    before = os.umask(0)
    yield
    os.umask(before)


def test_files_and_directories_are_private_whatever_the_umask(
    engine_client, adapters, tmp_path, open_umask
):
    data = tmp_path / "data"
    store = tmp_path / "store"
    data.mkdir(mode=0o777)
    (data / "loraplex.db").touch(mode=0o644)  # an old database left readable
    os.chmod(data / "loraplex.db", 0o644)
    key, path, created = load_or_create_admin_key(data)
    assert created and mode(path) == 0o600
    with LiveGateway(engine_client, data, adapter_store_dir=store) as gw:
        t = gw.create_tenant("acme")
        with gw.client(t["api_key"]) as c:
            digest = upload_dir(c, "a", adapters[0]).json()["digest"]
        assert mode(data) == 0o700
        assert mode(data / "secret.key") == 0o600
        assert mode(data / "loraplex.db") == 0o600
        for journal in ("loraplex.db-wal", "loraplex.db-shm"):
            if (data / journal).exists():
                assert mode(data / journal) == 0o600, journal
        assert mode(data / "uploads") == 0o700
        assert mode(store) == 0o700
        assert mode(store / digest) == 0o700
        for f in (store / digest).iterdir():
            assert mode(f) == 0o600, f
    fresh = tmp_path / "fresh"
    engine = make_engine(db_url(fresh.mkdir() or fresh))
    asyncio.run(engine.dispose())
    assert mode(fresh / "loraplex.db") == 0o600


# ------------------------------------------------------------------------ orphaned weights
def test_orphans_are_collected_at_start_up(engine_client, adapters, tmp_path, monkeypatch):
    """Weights whose removal the engine refused (a request was using them) survive the process
    that deferred them; the next start removes them and keeps every referenced one."""
    from loraplex.adapters.store import AdapterStore

    data, store_dir = tmp_path / "data", tmp_path / "store"
    with LiveGateway(engine_client, data, adapter_store_dir=store_dir) as gw:
        t = gw.create_tenant("acme")
        with gw.client(t["api_key"]) as c:
            kept = upload_dir(c, "kept", adapters[0]).json()["digest"]
            doomed = upload_dir(c, "doomed", adapters[1]).json()["digest"]

            async def busy(digest):  # as if a running request still used it
                return False

            monkeypatch.setattr(gw.state.engine, "remove_lora", busy)
            assert c.delete("/v1/adapters/doomed").status_code == 200
        assert gw.state.store.has(doomed)  # deferred, remembered only by this process
        monkeypatch.undo()
    store = AdapterStore(store_dir)
    stray = store.put_dir(adapters[2], **_limits(gw.state)).digest  # no row ever named it
    assert sorted(store.digests()) == sorted([kept, doomed, stray])
    with LiveGateway(engine_client, data, adapter_store_dir=store_dir) as gw:
        assert gw.state.store.digests() == [kept]
        t2 = gw.create_tenant("other")
        with gw.client(t2["api_key"]) as c:  # a later upload of a collected adapter is whole
            assert upload_dir(c, "again", adapters[1]).json()["digest"] == doomed
        assert gw.state.store.has(doomed)


def _insert_live_row(url: str, tenant_id: str, digest: str) -> None:
    async def main():
        engine = make_engine(url)
        try:
            async with session_factory(engine)() as session, session.begin():
                facts = AdapterFacts(digest, 4, 8.0, ["q_proj"], None)
                await create_adapter(session, tenant_id, "raced", facts)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_collector_puts_back_what_a_row_committed_meanwhile_references(live, adapters, monkeypatch):
    """The collector stashes a blob no row references; a gateway sharing the store commits a
    row for it right then; the collector's re-check sees the row and restores the blob."""
    t = live.create_tenant("acme")
    state = live.state
    with live.client(t["api_key"]) as c:
        digest = upload_dir(c, "x", adapters[0]).json()["digest"]
        assert c.delete("/v1/adapters/x").status_code == 200
    state.store.put_files(*read(adapters[0]), **_limits(state))  # stored again, no live row
    assert state.store.has(digest)
    real = state.store.stash

    def stash_then_race(d):
        stashed = real(d)
        _insert_live_row(state.config.db_url, t["id"], d)  # the other gateway's commit
        return stashed

    monkeypatch.setattr(state.store, "stash", stash_then_race)
    removed = asyncio.run(_remove(state, digest))
    assert removed is False and state.store.has(digest)
    monkeypatch.setattr(state.store, "stash", real)
    with live.client(t["api_key"]) as c:  # and with no row, it goes
        assert c.delete("/v1/adapters/raced").status_code == 200
    assert not state.store.has(digest)


def test_upload_stores_again_weights_collected_before_its_row_committed(
    live, adapters, monkeypatch
):
    """A collector (another gateway) removes the weights between this upload's store and its
    commit: the upload notices after committing and stores them again."""
    t = live.create_tenant("acme")
    real = adapter_service.store_adapter
    calls = []

    async def store_then_collected(state, config_bytes, weights_bytes):
        adapter = await real(state, config_bytes, weights_bytes)
        calls.append(adapter.digest)
        if len(calls) == 1:
            state.store.delete(adapter.digest)
        return adapter

    monkeypatch.setattr(adapter_service, "store_adapter", store_then_collected)
    with live.client(t["api_key"]) as c:
        r = upload_dir(c, "y", adapters[1])
        assert r.status_code == 201, r.text
    digest = r.json()["digest"]
    assert calls == [digest, digest]
    assert live.state.store.has(digest)


def _limits(state) -> dict:
    return {"limits": state.engine.adapter_limits}


async def _remove(state, digest: str) -> bool:
    engine = make_engine(state.config.db_url)
    try:
        return await remove_if_unused(session_factory(engine), state.store, digest)
    finally:
        await engine.dispose()


# ----------------------------------------------------------------------------- limits
@pytest.mark.parametrize("value", [2**63, 2**63 - 1, MAX_LIMIT + 1, 0, -1, 1.5, True, "10", 1e300])
def test_admin_limits_outside_the_column_range_are_400(live, value):
    t = live.create_tenant("acme")
    with live.admin() as c:
        r = c.put(f"/admin/tenants/{t['id']}/limits", json={"tokens_per_minute": value})
        err = assert_openai_error(r, 400)
        assert err["param"] == "tokens_per_minute"
        assert f"from 1 to {MAX_LIMIT}" in err["message"]
        r = c.post("/admin/tenants", json={"name": "b", "limits": {"requests_per_minute": value}})
        assert assert_openai_error(r, 400)["param"] == "requests_per_minute"
        assert [x["name"] for x in c.get("/admin/tenants").json()["data"]] == ["acme"]


def test_admin_limits_at_the_edges_of_the_range(live):
    t = live.create_tenant("acme")
    with live.admin() as c:
        r = c.put(
            f"/admin/tenants/{t['id']}/limits",
            json={"requests_per_minute": MAX_LIMIT, "tokens_per_minute": 1},
        )
        assert r.status_code == 200, r.text
        assert r.json()["limits"]["requests_per_minute"] == MAX_LIMIT
        r = c.post("/admin/tenants", json={"name": "b", "limits": {"max_concurrent_requests": 1}})
        assert r.status_code == 201, r.text


PG_URL = os.environ.get("LORAPLEX_TEST_PG_URL")


@pytest.mark.skipif(not PG_URL, reason="LORAPLEX_TEST_PG_URL is not set")
def test_admin_limits_range_fits_postgresql(engine_client, tmp_path):
    """On PostgreSQL (INTEGER is 32-bit) the top of the range is stored, one past it is a 400."""
    from tests.gateway.conftest import wipe_pg

    url = db_url(".", PG_URL)
    wipe_pg(url)
    with LiveGateway(engine_client, tmp_path / "pg", db=url) as gw:
        t = gw.create_tenant("acme")
        with gw.admin() as c:
            r = c.put(f"/admin/tenants/{t['id']}/limits", json={"tokens_per_minute": MAX_LIMIT})
            assert r.status_code == 200, r.text
            r = c.put(f"/admin/tenants/{t['id']}/limits", json={"tokens_per_minute": MAX_LIMIT + 1})
            assert assert_openai_error(r, 400)["param"] == "tokens_per_minute"
            assert c.get(f"/admin/tenants/{t['id']}").json()["limits"]["tokens_per_minute"] == (
                MAX_LIMIT
            )
