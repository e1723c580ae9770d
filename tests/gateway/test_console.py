"""Issue 33: the web console's rules, through Litestar's TestClient (no server, no browser).

Login with the admin or a tenant key, the session cookie's flags, CSRF on every change, each
tenant confined to its own tenant on every page and change, the failed-login throttle shared
with the API, session expiry and revocation, the usage queries' figures and the CSV export.
The real-browser walk-through is ``test_console_browser.py``.
"""

import csv
import html
import io
import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from litestar.testing import TestClient

from bench.fake_engine import InstantEngine
from loraplex.gateway.auth.keys import display_prefix
from loraplex.gateway.console.sessions import ConsoleSessions
from loraplex.gateway.db.session import db_url
from loraplex.gateway.server.build import build_gateway
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.usage.records import UsageRecord, record_usage_batch
from tests.gateway.conftest import with_db

ADMIN_KEY = "lpx-admin-console-test-0123456789abcdef012345"
T0 = datetime(2026, 11, 1, tzinfo=UTC)


class Gateway:
    """One app for the module: a TestClient and helpers that act as several browsers."""

    def __init__(self, tmp_path):
        config = GatewayConfig(
            data_dir=tmp_path,
            db_url=db_url(tmp_path),
            served_model_name="instant",
            auth_max_failures=5,
        )
        self.app, self.state = build_gateway(
            config, InstantEngine("instant"), admin_key=ADMIN_KEY, owns_engine=False
        )
        self.url = config.db_url

    def tenant(self, c, name):
        r = c.post("/admin/tenants", json={"name": name}, headers=bearer(ADMIN_KEY))
        assert r.status_code == 201, r.text
        return r.json()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


class Browser:
    """One logged-in browser: its session cookie and CSRF token, sent explicitly."""

    def __init__(self, c, key, base="http://testserver.local"):
        self.c, self.base = c, base
        c.cookies.clear()
        r = c.post("/console/login", data={"key": key}, follow_redirects=False)
        assert r.status_code == 303, r.text
        self.set_cookie = r.headers["set-cookie"]
        self.cookie = r.cookies["lpx_console"]
        c.cookies.clear()
        page = self.get("/console/keys")
        assert page.status_code == 200, page.text
        self.csrf = json.loads(re.search(r"hx-headers='([^']+)'", page.text).group(1))[
            "X-CSRF-Token"
        ]

    def headers(self, extra=None):
        return {"Cookie": f"lpx_console={self.cookie}", **(extra or {})}

    def get(self, path, **kw):
        self.c.cookies.clear()
        return self.c.get(path, headers=self.headers(kw.pop("headers", None)), **kw)

    def post(self, path, csrf=True, origin=None, **kw):
        self.c.cookies.clear()
        extra = {"HX-Request": "true", **kw.pop("headers", {})}
        if csrf:
            extra["X-CSRF-Token"] = self.csrf if csrf is True else csrf
        extra["Origin"] = origin or self.base
        return self.c.post(path, headers=self.headers(extra), follow_redirects=False, **kw)


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gateway = Gateway(tmp_path_factory.mktemp("console"))
    with TestClient(gateway.app) as c:
        gateway.c = c
        gateway.alpha = gateway.tenant(c, "alpha")
        gateway.beta = gateway.tenant(c, "beta")

        async def rows(sessions):
            records = []
            for i in range(48):  # alpha: 2 days, one request an hour; beta: one row
                records.append(
                    UsageRecord(
                        request_id=f"a{i}",
                        tenant_id=gateway.alpha["id"],
                        model="instant" if i % 2 else "=cmd|evil",
                        prompt_tokens=10,
                        completion_tokens=5,
                        cached_tokens=4,
                        images=1 if i == 0 else 0,
                        status="error" if i % 8 == 0 else "ok",
                        latency_ms=100.0 + i,
                        created_at=T0 + timedelta(hours=i, minutes=5),
                    )
                )
            records.append(
                UsageRecord(
                    request_id="b0",
                    tenant_id=gateway.beta["id"],
                    model="beta-secret-model",
                    prompt_tokens=999,
                    created_at=T0 + timedelta(hours=1),
                )
            )
            async with sessions() as s, s.begin():
                await record_usage_batch(s, records)

        with_db(gateway.url, rows)
        yield gateway


RANGE = {"since": "2026-11-01T00:00", "until": "2026-11-03T00:00"}


def test_login_gives_a_session_cookie_never_the_key(gw):
    admin = Browser(gw.c, ADMIN_KEY)
    flags = [f.strip().lower() for f in admin.set_cookie.split(";")]
    assert "httponly" in flags and "samesite=strict" in flags and "path=/console" in flags
    assert "secure" not in flags  # plain http here; see the https test
    assert ADMIN_KEY not in admin.set_cookie and len(admin.cookie) >= 43
    page = admin.get("/console/keys")
    assert ADMIN_KEY not in page.text and "admin (whole deployment)" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["cache-control"] == "no-store"


def test_the_cookie_is_secure_over_tls(gw):
    gw.c.cookies.clear()
    gw.c.base_url = "https://testserver.local"
    try:
        r = gw.c.post("/console/login", data={"key": gw.alpha["api_key"]}, follow_redirects=False)
    finally:
        gw.c.base_url = "http://testserver.local"
    assert r.status_code == 303
    assert "secure" in [f.strip().lower() for f in r.headers["set-cookie"].split(";")]


@pytest.mark.parametrize(
    "path",
    [
        "/console/usage",
        "/console/keys",
        "/console/adapters/",
        "/console/engine",
        "/console/usage.csv",
    ],
)
def test_pages_without_a_session_go_to_the_login(gw, path):
    gw.c.cookies.clear()
    r = gw.c.get(path, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    r = gw.c.get(path, headers={"Cookie": "lpx_console=forged"}, follow_redirects=False)
    assert r.status_code == 303
    r = gw.c.get(path, headers={"HX-Request": "true"}, follow_redirects=False)  # a fragment
    assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/login"


def test_changes_without_a_session_are_refused(gw):
    gw.c.cookies.clear()
    for path in ("/console/keys?tenant=" + gw.alpha["id"], "/console/tenants", "/console/logout"):
        assert gw.c.post(path, follow_redirects=False).status_code == 401


def test_wrong_keys_are_refused_and_throttled_with_the_api(gw):
    gw.c.cookies.clear()
    statuses = []
    for i in range(6):
        r = gw.c.post("/console/login", data={"key": f"lpx-wrong-{i}"}, follow_redirects=False)
        statuses.append(r.status_code)
        if r.status_code == 401:
            assert "invalid API key" in r.text
    assert statuses[:5] == [401] * 5 and statuses[5] == 429  # auth_max_failures=5
    assert int(r.headers["retry-after"]) >= 1
    # the same address's API calls are throttled too: one throttle for console and API
    assert gw.c.get("/v1/models", headers=bearer(gw.alpha["api_key"])).status_code == 429
    gw.state.auth_throttle._entries.clear()  # the next tests log in from this address


def test_login_refuses_empty_and_oversized_keys(gw):
    gw.c.cookies.clear()
    for key, status in (("", 400), ("x" * 600, 400)):
        r = gw.c.post("/console/login", data={"key": key}, follow_redirects=False)
        assert r.status_code == status and "lpx_console" not in r.headers.get("set-cookie", "")
    r = gw.c.post(
        "/console/login",
        data={"key": ADMIN_KEY},
        headers={"Origin": "https://evil.example"},
        follow_redirects=False,
    )
    assert r.status_code == 403 and "set-cookie" not in r.headers
    r = gw.c.post(  # no Origin, but the browser's Fetch Metadata says another site sent it
        "/console/login",
        data={"key": ADMIN_KEY},
        headers={"Sec-Fetch-Site": "cross-site"},
        follow_redirects=False,
    )
    assert r.status_code == 403 and "set-cookie" not in r.headers


def test_a_csv_cell_never_starts_a_formula():
    from loraplex.gateway.console.usage_page import safe_cell

    for text in ("=1+1", "+1", "-1", "@SUM(A1)", "\t=1", "\r=1"):
        assert safe_cell(text) == "'" + text
    assert safe_cell("llama-3 ft") == "llama-3 ft" and safe_cell(None) is None


def test_every_change_needs_the_csrf_token_and_the_own_origin(gw):
    admin = Browser(gw.c, ADMIN_KEY)
    path = "/console/keys?tenant=" + gw.beta["id"]
    before = len(admin.get("/console/keys?tenant=" + gw.beta["id"]).text)
    for kwargs in (
        {"csrf": False},
        {"csrf": "wrong-token"},
        {"origin": "https://evil.example"},
    ):
        r = admin.post(path, **kwargs)
        assert r.status_code == 403, kwargs
        assert "refused" in r.text and r.headers["hx-retarget"] == "#flash"
    assert len(admin.get("/console/keys?tenant=" + gw.beta["id"]).text) == before  # no new key
    r = admin.post(path)
    assert r.status_code == 200 and re.search(r'id="new-key">lpx-', r.text)
    assert admin.post("/console/logout", csrf=False).status_code == 403  # logout too
    r = admin.post("/console/logout")
    assert r.status_code == 200 and r.headers["hx-redirect"] == "/console/login"
    assert admin.get("/console/usage", follow_redirects=False).status_code == 303  # ended


def test_a_tenant_is_refused_every_other_tenant_url(gw):
    alpha = Browser(gw.c, gw.alpha["api_key"])
    beta_id = gw.beta["id"]
    for path in (
        f"/console/usage?tenant={beta_id}",
        f"/console/usage.csv?tenant={beta_id}",
        f"/console/keys?tenant={beta_id}",
        f"/console/adapters/?tenant={beta_id}",
    ):
        r = alpha.get(path)
        assert r.status_code == 403, path
        assert "beta" not in r.text, path
    for path in (
        f"/console/keys?tenant={beta_id}",
        f"/console/adapters/x/delete?tenant={beta_id}",
        f"/console/adapters/?tenant={beta_id}",
    ):
        assert alpha.post(path).status_code == 403, path
    assert alpha.post("/console/tenants", data={"name": "mallory"}).status_code == 403
    # beta's key id: refused like an unknown id, and the key still works
    r = alpha.post(f"/console/keys/{gw.beta['key_id']}/revoke")
    assert r.status_code == 404
    assert gw.c.get("/v1/models", headers=bearer(gw.beta["api_key"])).status_code == 200
    # alpha's own pages show alpha's data only
    page = alpha.get("/console/usage", params=RANGE).text
    assert "beta-secret-model" not in page and "beta" not in page.split("<main>")[1]
    rows = list(csv.DictReader(io.StringIO(alpha.get("/console/usage.csv", params=RANGE).text)))
    assert rows and {r["tenant_id"] for r in rows} == {gw.alpha["id"]}
    keys = alpha.get("/console/keys").text
    assert gw.alpha["key_id"] in keys and gw.beta["key_id"] not in keys
    assert 'id="tenants"' not in keys  # no tenant list for a tenant


def test_usage_figures_and_csv(gw):
    admin = Browser(gw.c, ADMIN_KEY)
    page = admin.get("/console/usage", params={**RANGE, "tenant": gw.alpha["id"]})
    assert page.status_code == 200
    plot = json.loads(re.search(r'id="usage-data">(.*?)</script>', page.text).group(1))
    assert len(plot["t"]) == 48 and plot["t"][0] == int(T0.timestamp())
    assert sum(plot["requests"]) == 48 and sum(plot["errors"]) == 6
    assert sum(plot["prompt_tokens"]) == 480 and sum(plot["cached_tokens"]) == 192
    assert sum(plot["images"]) == 1
    for i, p50 in enumerate(plot["p50"]):  # one latency per hour: its bin, within 6.5 %
        assert abs(p50 - (100 + i)) / (100 + i) < 0.065
    daily = admin.get("/console/usage", params={**RANGE, "bucket": "day", "tenant": ""}).text
    plot = json.loads(re.search(r'id="usage-data">(.*?)</script>', daily).group(1))
    assert plot["requests"] == [24 + 1, 24]  # every tenant for the admin: beta's row too
    assert "beta-secret-model" in daily
    only = admin.get("/console/usage", params={**RANGE, "model": "instant"}).text
    assert (
        json.loads(re.search(r'id="usage-data">(.*?)</script>', only).group(1))["requests"].count(1)
        == 24
    )
    r = admin.get("/console/usage.csv", params={**RANGE, "tenant": gw.alpha["id"]})
    assert r.headers["content-type"].startswith("text/csv")
    assert "attachment" in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == 48 and sum(int(x["requests"]) for x in rows) == 48
    assert {x["model"] for x in rows} == {"instant", "'=cmd|evil"}  # no spreadsheet formula
    assert set(rows[0]) >= {"start", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms"}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"bucket": "week"}, "bucket"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-01-01", "until": "2026-06-01"}, "since"),  # > 62 days per hour
        ({"since": "2026-06-01", "until": "2026-01-01"}, "since"),
        ({"model": "m" * 300}, "model"),
        ({"model": "a\x00b"}, "model"),
        ({"tenant": "t\x00"}, "tenant"),
        ({"until": "0001-01-02"}, "until"),  # the default span would start before year 1
        ({"since": "2026-01-01", "until": "9999-12-31T23:30"}, "until"),  # rounds past 9999
    ],
)
def test_bad_usage_queries_are_400_naming_the_field(gw, params, field):
    admin = Browser(gw.c, ADMIN_KEY)
    r = admin.get("/console/usage", params=params)
    assert r.status_code == 400 and f"'{field}" in html.unescape(r.text)


def test_the_csv_export_is_bounded(gw, monkeypatch):
    monkeypatch.setattr("loraplex.gateway.console.usage_page.MAX_CSV_ROWS", 47)
    admin = Browser(gw.c, ADMIN_KEY)
    r = admin.get("/console/usage.csv", params={**RANGE, "tenant": gw.alpha["id"]})
    assert r.status_code == 400 and "over 47 rows" in r.text  # alpha has 48 (hour, model)s
    monkeypatch.setattr("loraplex.gateway.console.usage_page.MAX_CSV_ROWS", 48)
    r = admin.get("/console/usage.csv", params={**RANGE, "tenant": gw.alpha["id"]})
    assert r.status_code == 200 and len(r.text.splitlines()) == 49


def test_admin_creates_a_tenant_and_a_revoked_key_ends_its_sessions(gw):
    admin = Browser(gw.c, ADMIN_KEY)
    r = admin.post("/console/tenants", data={"name": "gamma"})
    assert r.status_code == 200
    key = re.search(r'id="new-key">(lpx-[^<]+)<', r.text).group(1)
    assert gw.c.get("/v1/models", headers=bearer(key)).status_code == 200
    gamma = Browser(gw.c, key)
    assert gamma.get("/console/keys").status_code == 200
    key_id = re.search(r'data-key-id="([0-9a-f]{32})"', gamma.get("/console/keys").text).group(1)
    r = admin.post(f"/console/keys/{key_id}/revoke")
    assert r.status_code == 200 and "revoked" in r.text
    assert gw.c.get("/v1/models", headers=bearer(key)).status_code == 401  # cache dropped too
    assert gamma.get("/console/keys", follow_redirects=False).status_code == 303
    assert admin.post("/console/tenants", data={"name": ""}).status_code == 400


def test_a_tenant_mints_a_bounded_number_of_live_keys(gw, monkeypatch):
    monkeypatch.setattr("loraplex.gateway.console.keys_page.MAX_TENANT_KEYS", 3, raising=False)
    admin = Browser(gw.c, ADMIN_KEY)
    r = admin.post("/console/tenants", data={"name": "delta"})
    delta = Browser(gw.c, re.search(r'id="new-key">(lpx-[^<]+)<', r.text).group(1))
    made = [delta.post("/console/keys") for _ in range(3)]
    assert [m.status_code for m in made] == [200, 200, 409]  # its login key is the first
    assert "at most 3 live keys" in html.unescape(made[-1].text)
    minted = re.search(r'id="new-key">(lpx-[^<]+)<', made[0].text).group(1)
    row = r'data-key-id="([0-9a-f]{32})"><td><code>[0-9a-f]{32}</code></td><td><code>'
    key_id = re.search(row + re.escape(display_prefix(minted)), made[0].text).group(1)
    assert delta.post(f"/console/keys/{key_id}/revoke").status_code == 200
    assert delta.post("/console/keys").status_code == 200  # a revoked key frees its place
    tenant_id = re.search(r"tenant=([0-9a-f]{32})", made[0].text).group(1)
    assert admin.post(f"/console/keys?tenant={tenant_id}").status_code == 200  # admin: no bound


def test_the_engine_page_shows_aggregates_only(gw):
    alpha = Browser(gw.c, gw.alpha["api_key"])
    r = alpha.get("/console/engine/live", headers={"HX-Request": "true"})
    assert r.status_code == 200 and 'id="kv-blocks"' in r.text and "running" in r.text
    page = alpha.get("/console/engine").text
    assert 'hx-trigger="every 2s"' in page and gw.beta["id"] not in page


def test_assets_are_served_offline_with_their_licences(gw):
    page = Browser(gw.c, ADMIN_KEY).get("/console/usage").text
    scripts = re.findall(r'(?:src|href)="([^"]+)"', page.split("</head>")[0])
    assert scripts and all(s.startswith("/console/static/") for s in scripts)  # no CDN
    for path in scripts + ["/console/static/htmx.LICENSE", "/console/static/uPlot.LICENSE"]:
        assert gw.c.get(path).status_code == 200, path


def test_sessions_expire_and_are_bounded():
    now = [0.0]
    store = ConsoleSessions(
        idle_seconds=10, max_age_seconds=25, max_sessions=2, clock=lambda: now[0]
    )
    s = store.start(admin=True)
    now[0] = 9
    assert store.get(s.id) is s  # used: the idle clock restarts
    now[0] = 18
    assert store.get(s.id) is s
    now[0] = 26
    assert store.get(s.id) is None  # older than max_age, used or not
    a = store.start(admin=False, tenant_id="t", key_id="k")
    now[0] = 37
    assert store.get(a.id) is None  # idle too long
    a, b, c = (store.start(admin=False, key_id="k") for _ in range(3))
    assert len(store) == 2 and store.get(a.id) is None  # the least recently used went
    assert store.end_key("k") == 2 and len(store) == 0
    assert store.get(None) is None and store.get("") is None


def test_one_tenant_logging_in_again_and_again_ends_only_its_own_sessions():
    store = ConsoleSessions(max_sessions=100)
    admin = store.start(admin=True)
    other = store.start(admin=False, tenant_id="beta", key_id="kb")
    flood = [store.start(admin=False, tenant_id="alpha", key_id="ka") for _ in range(300)]
    assert store.get(admin.id) is admin and store.get(other.id) is other
    live = [s for s in flood if store.get(s.id) is not None]
    assert 0 < len(live) <= store.max_sessions_per_tenant and live[-1] is flood[-1]
    assert store.end_key("ka") == len(live) and len(store) == 2
    store.end(admin.id)
    assert store.get(admin.id) is None and len(store) == 1


def tiny_adapter(rank=4):
    """A PEFT LoRA adapter for InstantEngine's targets: (adapter_config.json, safetensors)."""
    import numpy as np
    from safetensors.numpy import save

    tensors = {}
    for layer in (0, 1):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = np.full((rank, 64), 0.01, np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.full((64, rank), 0.01, np.float32)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
    }
    return json.dumps(config).encode(), save(tensors)


def test_adapter_upload_list_and_delete_are_the_tenants_own(gw):
    alpha = Browser(gw.c, gw.alpha["api_key"])
    config, weights = tiny_adapter()
    files = [
        ("files", ("adapter_config.json", config, "application/json")),
        ("files", ("adapter_model.safetensors", weights, "application/octet-stream")),
    ]
    assert (
        alpha.post("/console/adapters/", csrf=False, data={"name": "x"}, files=files).status_code
        == 403
    )
    r = alpha.post("/console/adapters/", data={"name": "support-bot"}, files=files)
    assert r.status_code == 200, r.text
    row = re.search(r'<tr data-adapter="support-bot">(.*?)</tr>', r.text, re.S).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row, re.S)
    assert cells[1] == "support-bot" and cells[3] == "4" and cells[5] == "q_proj, v_proj"
    size = len(config) + len(weights)  # the store keeps the two files as sent
    assert cells[2] == f"{size / 1024:.1f} KiB"
    # the API sees the same adapter; beta's console sees none of it
    api = gw.c.get("/v1/adapters/support-bot", headers=bearer(gw.alpha["api_key"])).json()
    assert api["digest"][:16] in row and api["rank"] == 4
    beta = Browser(gw.c, gw.beta["api_key"])
    assert "support-bot" not in beta.get("/console/adapters/").text
    assert beta.post("/console/adapters/support-bot/delete").status_code == 404
    assert (
        beta.post(f"/console/adapters/support-bot/delete?tenant={gw.alpha['id']}").status_code
        == 403
    )
    r = alpha.post("/console/adapters/", data={"name": "bad"}, files=files[:1])
    assert r.status_code == 400 and "adapter_model.safetensors" in html.unescape(r.text)
    r = alpha.post("/console/adapters/support-bot/delete")
    assert r.status_code == 200 and "support-bot" not in r.text
    assert (
        gw.c.get("/v1/adapters/support-bot", headers=bearer(gw.alpha["api_key"])).status_code == 404
    )


def test_the_rollups_count_each_request_once_in_its_own_hour(gw):
    """The trigger: a duplicate write adds nothing, a late row lands in its hour, bins follow."""
    late = T0 + timedelta(days=5, hours=5, minutes=30)  # outside RANGE: the other tests' figures

    async def write(sessions):
        again = UsageRecord(request_id="a3", tenant_id=gw.alpha["id"], model="instant")
        late_row = UsageRecord(
            request_id="late-1",
            tenant_id=gw.alpha["id"],
            model="instant",
            prompt_tokens=7,
            latency_ms=5000.0,
            created_at=late,
        )
        async with sessions() as s, s.begin():
            await record_usage_batch(s, [again, late_row])

    with_db(gw.url, write)
    admin = Browser(gw.c, ADMIN_KEY)
    page = admin.get("/console/usage", params={**RANGE, "tenant": gw.alpha["id"]}).text
    plot = json.loads(re.search(r'id="usage-data">(.*?)</script>', page).group(1))
    assert sum(plot["requests"]) == 48  # the duplicate of a3 added nothing
    params = {"since": "2026-11-06T00:00", "until": "2026-11-06T12:00", "tenant": gw.alpha["id"]}
    plot = json.loads(
        re.search(
            r'id="usage-data">(.*?)</script>', admin.get("/console/usage", params=params).text
        ).group(1)
    )
    hour = plot["t"].index(int(late.replace(minute=0).timestamp()))
    assert plot["requests"][hour] == 1 == sum(plot["requests"])
    assert plot["prompt_tokens"][hour] == 7
    assert abs(plot["p99"][hour] - 5000) / 5000 < 0.065


def test_migration_0006_backfills_the_rollups_from_existing_rows(tmp_path):
    from sqlalchemy import text

    from loraplex.gateway.db.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0004")
    rows = [("r1", 10, 100.0, "ok"), ("r2", 20, None, "error"), ("r3", 30, 100.0, "aborted")]

    async def old_rows(sessions):
        async with sessions() as s, s.begin():
            await s.execute(
                text("INSERT INTO tenants (id, name, created_at) VALUES ('t', 't', '2026-01-01')")
            )
            for rid, prompt, latency, status in rows:
                await s.execute(
                    text(
                        "INSERT INTO usage_events (request_id, tenant_id, model, prompt_tokens, "
                        "completion_tokens, cached_tokens, images, status, created_at, latency_ms) "
                        "VALUES (:r, 't', 'm', :p, 0, 0, 0, :s, '2026-01-01 10:20:00.000000', :l)"
                    ),
                    {"r": rid, "p": prompt, "s": status, "l": latency},
                )

    with_db(url, old_rows)
    upgrade(url)

    async def read(sessions):
        async with sessions() as s:
            hourly = (await s.execute(text("SELECT * FROM usage_hourly"))).mappings().all()
            bins = await s.execute(
                text("SELECT model, bin, requests FROM usage_hourly_latency ORDER BY model")
            )
            return [dict(h) for h in hourly], [tuple(b) for b in bins]

    hourly, bins = with_db(url, read)
    assert hourly == [
        {
            "tenant_id": "t",
            "hour": "2026-01-01 10",
            "model": "m",
            "requests": 3,
            "prompt_tokens": 60,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "images": 0,
            "errors": 1,
            "aborted": 1,
        }
    ]
    assert bins == [("", 36, 2), ("m", 36, 2)]  # floor(8 ln 101) = 36; the NULL latency: none


def check_usage_queries(url):
    """The console's queries on the database at ``url`` (migrated; SQLite or PostgreSQL)."""
    from loraplex.gateway.console.usage_queries import usage_breakdown, usage_buckets

    async def body(sessions):
        from loraplex.gateway.db.models import Tenant

        async with sessions() as s, s.begin():
            s.add_all([Tenant(id="t1", name="one"), Tenant(id="t2", name="two")])
        records = [
            UsageRecord(
                request_id=f"q{i}",
                tenant_id="t1" if i < 30 else "t2",
                model=("base", "ad")[i % 2],
                prompt_tokens=i,
                status="error" if i % 10 == 0 else "ok",
                latency_ms=float(10 * (i + 1)),
                created_at=T0 + timedelta(hours=i % 30, minutes=59),
            )
            for i in range(40)
        ]
        async with sessions() as s, s.begin():
            await record_usage_batch(s, records)
            await record_usage_batch(s, records[:5])  # duplicates: nothing
        end = T0 + timedelta(days=2)
        async with sessions() as s:
            hours = await usage_buckets(s, tenant_id="t1", since=T0, until=end)
            days = await usage_buckets(s, tenant_id=None, since=T0, until=end, bucket="day")
            split = await usage_buckets(s, tenant_id="t1", since=T0, until=end, split=True)
            only = await usage_buckets(s, tenant_id="t1", since=T0, until=end, model="ad")
            table = await usage_breakdown(s, tenant_id=None, since=T0, until=end)
        return hours, days, split, only, table

    hours, days, split, only, table = with_db(url, body)
    assert [b.counts["requests"] for b in hours] == [1] * 30
    assert [b.start for b in hours] == [T0 + timedelta(hours=h) for h in range(30)]
    assert sum(b.counts["prompt_tokens"] for b in hours) == sum(range(30))
    assert sum(b.counts["errors"] for b in hours) == 3
    for h, b in enumerate(hours):
        assert abs(b.percentile(50) - 10 * (h + 1)) / (10 * (h + 1)) < 0.065
    assert [(b.start.day, b.counts["requests"]) for b in days] == [(1, 34), (2, 6)]
    assert {(b.model, b.tenant_id) for b in split} == {("base", "t1"), ("ad", "t1")}
    assert sum(b.counts["requests"] for b in only) == 15
    assert all(b.percentile(99) is not None for b in only)
    assert [(r["tenant"], r["model"], r["requests"]) for r in table] == [
        ("one", "ad", 15),  # heaviest first: prompt tokens 225, 210, 175, 170
        ("one", "base", 15),
        ("two", "ad", 5),
        ("two", "base", 5),
    ]


def test_usage_queries_on_sqlite(database_url):
    check_usage_queries(database_url)


def test_reloading_the_usage_page_does_not_flush_the_usage_writer_each_time(gw, monkeypatch):
    from loraplex.gateway.console import usage_page

    flushes = []
    real = gw.state.usage.flush

    async def counted(timeout=None):
        flushes.append(timeout)
        await real(timeout=timeout)

    monkeypatch.setattr(gw.state.usage, "flush", counted)
    usage_page._last_flush.pop(gw.state.usage, None)
    alpha = Browser(gw.c, gw.alpha["api_key"])
    for _ in range(5):  # a tenant reloading in a loop
        assert alpha.get("/console/usage", params=RANGE).status_code == 200
    assert len(flushes) == 1
    usage_page._last_flush[gw.state.usage] -= usage_page.FLUSH_INTERVAL_S  # time passes
    assert alpha.get("/console/usage", params=RANGE).status_code == 200
    assert len(flushes) == 2
