"""Service tests; ``test_pg.py`` runs them again on PostgreSQL."""

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from loraplex.gateway.auth.keys import generate_key, hash_key
from loraplex.gateway.db.models import Adapter, ApiKey, UsageEvent
from loraplex.gateway.services.errors import ConflictError, InvalidInputError, NotFoundError
from loraplex.gateway.services.keys import authenticate, create_key, get_key, list_keys, revoke_key
from loraplex.gateway.services.tenants import (
    TenantLimits,
    create_tenant,
    create_tenant_with_key,
    get_tenant,
    limits_of,
    list_tenants,
    set_limits,
)
from loraplex.gateway.usage.records import UsageRecord, parse_time, record_usage, usage_summary
from tests.gateway.conftest import SECRET, with_db

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def test_tenant_create_get_list_and_conflict(database_url):
    async def body(sessions):
        async with sessions.begin() as s:
            acme = await create_tenant(s, "acme")
            await create_tenant(s, "globex")
        async with sessions() as s:
            assert (await get_tenant(s, acme.id)).name == "acme"
            assert [t.name for t in await list_tenants(s)] == ["acme", "globex"]
            assert acme.created_at.tzinfo is not None
            with pytest.raises(NotFoundError):
                await get_tenant(s, "missing")
        with pytest.raises(ConflictError):
            async with sessions.begin() as s:
                await create_tenant(s, "acme")
        with pytest.raises(InvalidInputError):
            async with sessions.begin() as s:
                await create_tenant(s, "  ")

    with_db(database_url, body)


def test_tenant_limits(database_url):
    async def body(sessions):
        async with sessions.begin() as s:
            tenant = await create_tenant(s, "acme", TenantLimits(requests_per_minute=10))
        async with sessions.begin() as s:
            await set_limits(s, tenant.id, TenantLimits(tokens_per_minute=500))
        async with sessions() as s:
            limits = limits_of(await get_tenant(s, tenant.id))
        assert limits == TenantLimits(None, 500, None)
        defaults = TenantLimits(60, 10_000, 4)
        assert limits.or_defaults(defaults) == TenantLimits(60, 500, 4)
        with pytest.raises(InvalidInputError):
            async with sessions.begin() as s:
                await set_limits(s, tenant.id, TenantLimits(max_concurrent_requests=0))
        with pytest.raises(NotFoundError):
            async with sessions.begin() as s:
                await set_limits(s, "missing", TenantLimits())

    with_db(database_url, body)


def test_key_lifecycle(database_url):
    async def body(sessions):
        async with sessions.begin() as s:
            tenant, first = await create_tenant_with_key(s, "acme", SECRET)
            second = await create_key(s, tenant.id, SECRET)
        assert first.api_key not in repr(first)
        async with sessions() as s:
            stored = await get_key(s, first.id)
            # only the HMAC and the display prefix are stored
            assert stored.key_hash == hash_key(first.api_key, SECRET)
            assert stored.prefix == first.api_key[:8]
            assert [k.id for k in await list_keys(s, tenant.id)] == [first.id, second.id]
            who = await authenticate(s, first.api_key, SECRET)
            assert who is not None
            assert (who.tenant.id, who.key.id) == (tenant.id, first.id)
            # unknown key, wrong secret, malformed token, the hash itself
            assert await authenticate(s, generate_key(), SECRET) is None
            assert await authenticate(s, first.api_key, b"x" * 32) is None
            assert await authenticate(s, "Bearer nonsense", SECRET) is None
            assert await authenticate(s, stored.key_hash, SECRET) is None
            assert await authenticate(s, "lpx-" + "a" * 5000, SECRET) is None
        async with sessions.begin() as s:
            revoked = await revoke_key(s, first.id)
            when = revoked.revoked_at
        async with sessions.begin() as s:  # idempotent: the first time stays
            assert (await revoke_key(s, first.id)).revoked_at == when
        async with sessions() as s:
            assert await authenticate(s, first.api_key, SECRET) is None
            assert (await authenticate(s, second.api_key, SECRET)).key.id == second.id
        with pytest.raises(NotFoundError):
            async with sessions.begin() as s:
                await revoke_key(s, "missing")
        with pytest.raises(NotFoundError):
            async with sessions.begin() as s:
                await create_key(s, "missing", SECRET)

    with_db(database_url, body)


def test_tenant_with_key_is_one_transaction(database_url):
    async def body(sessions):
        async with sessions.begin() as s:
            await create_tenant(s, "acme")
        with pytest.raises(ConflictError):
            async with sessions.begin() as s:
                await create_tenant_with_key(s, "acme", SECRET)
        async with sessions() as s:
            assert await s.scalar(select(func.count()).select_from(ApiKey)) == 0

    with_db(database_url, body)


async def _two_tenants(sessions):
    async with sessions.begin() as s:
        a, ka = await create_tenant_with_key(s, "acme", SECRET)
        b, kb = await create_tenant_with_key(s, "globex", SECRET)
    return a.id, ka.id, b.id, kb.id


def test_usage_is_recorded_once_per_request_id(database_url):
    async def body(sessions):
        a, ka, _, _ = await _two_tenants(sessions)
        rec = UsageRecord("req-1", a, "base", key_id=ka, prompt_tokens=10, completion_tokens=5)
        async with sessions.begin() as s:
            assert await record_usage(s, rec) is True
        async with sessions.begin() as s:  # a retry, even with other numbers, is not counted
            assert await record_usage(s, rec, completion_tokens=99) is False
        async with sessions.begin() as s:
            assert await record_usage(s, rec) is False
            assert await record_usage(s, request_id="req-2", tenant_id=a, model="base") is True
        async with sessions() as s:
            assert await s.scalar(select(func.count()).select_from(UsageEvent)) == 2
            summary = await usage_summary(s, a)
            key = await get_key(s, ka)
        assert summary["totals"]["requests"] == 2
        assert summary["totals"]["completion_tokens"] == 5
        assert key.last_used_at is not None  # touched by record_usage

    with_db(database_url, body)


def test_usage_record_validation(database_url):
    async def body(sessions):
        a, _, _, _ = await _two_tenants(sessions)
        for bad in ({"status": "weird"}, {"prompt_tokens": -1}, {"model": ""}):
            with pytest.raises(InvalidInputError):
                async with sessions.begin() as s:
                    await record_usage(s, UsageRecord("r", a, "base"), **bad)

    with_db(database_url, body)


def test_usage_summary_groups_filters_and_isolates(database_url):
    async def body(sessions):
        a, ka, b, kb = await _two_tenants(sessions)
        plus2 = timezone(timedelta(hours=2))
        rows = [
            # request, tenant, model, prompt, completion, cached, images, status, when
            ("r1", a, "base", 10, 5, 0, 0, "ok", T0),
            ("r2", a, "base", 20, 7, 16, 1, "ok", T0 + timedelta(hours=1)),
            ("r3", a, "my-lora", 30, 2, 0, 2, "aborted", T0 + timedelta(hours=2)),
            ("r4", a, "my-lora", 40, 0, 0, 0, "error", (T0 + timedelta(hours=3)).astimezone(plus2)),
            ("r5", b, "base", 1000, 1000, 1000, 9, "ok", T0 + timedelta(hours=1)),
        ]
        async with sessions.begin() as s:
            for rid, tenant, model, p, c, cached, img, status, when in rows:
                await record_usage(
                    s,
                    UsageRecord(
                        rid,
                        tenant,
                        model,
                        key_id=ka if tenant == a else kb,
                        prompt_tokens=p,
                        completion_tokens=c,
                        cached_tokens=cached,
                        images=img,
                        status=status,
                        error_type="engine" if status == "error" else None,
                        created_at=when,
                        ttft_ms=1.5,
                        latency_ms=20.0,
                    ),
                )
        async with sessions() as s:
            everything = await usage_summary(s, a)
            window = await usage_summary(
                s, a, since=T0 + timedelta(hours=1), until=T0 + timedelta(hours=3)
            )
            naive_since = await usage_summary(s, a, since=datetime(2025, 3, 1, 14, 0))
            other = await usage_summary(s, b)
            nobody = await usage_summary(s, "no-such-tenant")
        assert everything == {
            "object": "usage",
            "tenant": a,
            "totals": {"requests": 4, "prompt_tokens": 100, "completion_tokens": 14,
                       "cached_tokens": 16, "images": 3},
            "by_model": [
                {"model": "base", "requests": 2, "prompt_tokens": 30, "completion_tokens": 12,
                 "cached_tokens": 16, "images": 1},
                {"model": "my-lora", "requests": 2, "prompt_tokens": 70, "completion_tokens": 2,
                 "cached_tokens": 0, "images": 2},
            ],
        }  # fmt: skip
        # since is inclusive, until exclusive: r2 and r3
        assert window["totals"] == {"requests": 2, "prompt_tokens": 50, "completion_tokens": 9,
                                    "cached_tokens": 16, "images": 3}  # fmt: skip
        assert [m["model"] for m in window["by_model"]] == ["base", "my-lora"]
        # naive means UTC; r4 was given in UTC+2 and is 15:00 UTC
        assert [m["requests"] for m in naive_since["by_model"]] == [2]
        assert naive_since["totals"]["prompt_tokens"] == 70
        assert other["totals"]["requests"] == 1 and other["tenant"] == b
        assert nobody["totals"] == dict.fromkeys(
            ["requests", "prompt_tokens", "completion_tokens", "cached_tokens", "images"], 0
        )
        assert nobody["by_model"] == []

    with_db(database_url, body)


def test_parse_time():
    assert parse_time(None) is None
    assert parse_time("2025-03-01T12:00:00Z") == T0
    assert parse_time("2025-03-01T14:00:00+02:00") == T0
    assert parse_time("2025-03-01T12:00:00") == T0
    assert parse_time("2025-03-01") == T0 - timedelta(hours=12)
    with pytest.raises(InvalidInputError):
        parse_time("yesterday")


def test_adapter_names_unique_among_live_rows(database_url):
    def adapter(tenant_id, name, digest, deleted_at=None):
        return Adapter(
            tenant_id=tenant_id, name=name, digest=digest, rank=8, lora_alpha=16.0,
            target_modules=["q_proj", "v_proj"], deleted_at=deleted_at,
        )  # fmt: skip

    async def body(sessions):
        a, _, b, _ = await _two_tenants(sessions)
        async with sessions.begin() as s:
            old = adapter(a, "style", "d1")
            s.add_all([old, adapter(b, "style", "d9")])  # same name, other tenant: fine
        with pytest.raises(IntegrityError):
            async with sessions.begin() as s:
                s.add(adapter(a, "style", "d2"))
        async with sessions.begin() as s:  # replace: retire the old row, add the new one
            (await s.get(Adapter, old.id)).deleted_at = T0
            await s.flush()
            s.add(adapter(a, "style", "d2"))
        async with sessions() as s:
            rows = (await s.scalars(select(Adapter).where(Adapter.tenant_id == a))).all()
            assert sorted((r.digest, r.deleted_at is None) for r in rows) == [
                ("d1", False),
                ("d2", True),
            ]
            assert rows[0].target_modules == ["q_proj", "v_proj"]

    with_db(database_url, body)


def test_adapter_service_create_replace_delete(database_url):
    from loraplex.gateway.services.adapters import (
        AdapterFacts,
        create_adapter,
        delete_adapter,
        digest_in_use,
        get_adapter,
        list_adapters,
    )

    def facts(digest):
        return AdapterFacts(digest, 4, 8, ("q_proj", "v_proj"), "tiny")

    async def body(sessions):
        a, _, b, _ = await _two_tenants(sessions)
        async with sessions.begin() as s:
            first, replaced = await create_adapter(s, a, "style", facts("d1"))
            await create_adapter(s, b, "style", facts("d1"))  # per-tenant names, shared digest
        assert replaced is None and first.lora_alpha == 8.0
        with pytest.raises(ConflictError, match="replace=true"):
            async with sessions.begin() as s:
                await create_adapter(s, a, "style", facts("d2"))
        async with sessions.begin() as s:  # one transaction: retire and insert
            second, replaced = await create_adapter(s, a, "style", facts("d2"), replace=True)
        assert replaced.id == first.id and replaced.deleted_at is not None
        async with sessions() as s:
            assert (await get_adapter(s, a, "style")).digest == "d2"
            assert [r.digest for r in await list_adapters(s, a)] == ["d2"]
            assert await digest_in_use(s, "d1")  # b's row still holds it
        async with sessions.begin() as s:
            await delete_adapter(s, b, "style")
        async with sessions() as s:
            assert not await digest_in_use(s, "d1")
            with pytest.raises(NotFoundError):
                await get_adapter(s, b, "style")
        with pytest.raises(NotFoundError):
            async with sessions.begin() as s:
                await delete_adapter(s, b, "style")
        async with sessions.begin() as s:  # the name is free again after a delete
            await create_adapter(s, b, "style", facts("d3"))

    with_db(database_url, body)
