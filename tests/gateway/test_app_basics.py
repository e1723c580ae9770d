"""The live gateway's plumbing: health, metrics, auth failures and OpenAI error bodies."""

from tests.gateway.live import ADMIN_KEY


def assert_openai_error(response, status, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_health_needs_no_key_and_metrics_the_admin_key(live):
    with live.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert_openai_error(c.get("/metrics"), 401)  # tests/gateway/test_metrics_access.py
    text = live.metrics()
    for name in (
        "loraplex_kv_blocks_total",
        "loraplex_kv_blocks_in_use",
        "loraplex_prefix_cache_queried_tokens_total",
        "loraplex_prefix_cache_hit_tokens_total",
        "loraplex_requests_running",
        "loraplex_requests_waiting",
        "loraplex_lora_slots_in_use",
    ):
        assert f"\n{name} " in text, name
    assert "loraplex_kv_blocks_total 512.0" in text
    # 512 blocks of the tiny model's 16 KiB (4 layers x 16 tokens x 2 heads x 16 x K,V x 4 B).
    assert "\nloraplex_kv_cache_bytes 8.388608e+06\n" in text


def test_unknown_route_is_an_openai_404(live):
    with live.client(ADMIN_KEY) as c:
        err = assert_openai_error(c.get("/v1/nothing-here"), 404)
    assert err["type"] == "invalid_request_error"


def test_missing_and_malformed_keys_are_401(live):
    with live.client() as c:
        assert_openai_error(c.get("/v1/models"), 401)
        r = c.get("/v1/models", headers={"Authorization": "Basic abc"})
        assert_openai_error(r, 401)
        r = c.get("/v1/models", headers={"Authorization": "Bearer lpx-notakey"})
        assert_openai_error(r, 401)


def test_health_is_503_while_draining(live):
    live.state.draining = True
    try:
        with live.client() as c:
            assert_openai_error(c.get("/health"), 503)
    finally:
        live.state.draining = False


def test_admin_routes(live):
    t = live.create_tenant("acme")
    assert t["api_key"].startswith("lpx-") and t["name"] == "acme"
    with live.admin() as c:
        assert_openai_error(c.post("/admin/tenants", json={"name": "acme"}), 409)
        assert_openai_error(c.post("/admin/tenants", json={"nam": "x"}), 400)
        r = c.post(
            "/admin/tenants", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert_openai_error(r, 400)
        assert_openai_error(c.post("/admin/tenants/nope/keys"), 404)
        key = c.post(f"/admin/tenants/{t['id']}/keys")
        assert key.status_code == 201 and key.json()["api_key"].startswith("lpx-")
        view = c.get(f"/admin/tenants/{t['id']}").json()
        assert len(view["keys"]) == 2 and all("hash" not in k for k in view["keys"])
        assert view["keys"][0]["id"] == t["key_id"]  # the first key, named at creation
        r = c.put(f"/admin/tenants/{t['id']}/limits", json={"requests_per_minute": 5})
        assert r.status_code == 200, r.text
        assert r.json()["limits"]["requests_per_minute"] == 5
        assert_openai_error(
            c.put(f"/admin/tenants/{t['id']}/limits", json={"requests_per_minute": -1}), 400
        )
        assert_openai_error(c.delete("/admin/keys/nope"), 404)
    # a tenant key never serves /admin/*
    with live.client(t["api_key"]) as c:
        assert_openai_error(c.get("/admin/tenants"), 403)
        assert_openai_error(c.post("/admin/tenants", json={"name": "evil"}), 403)
    # revocation takes effect at once, even for a key the auth cache holds
    with live.client(key.json()["api_key"]) as c:
        assert c.get("/admin/tenants").status_code == 403  # authenticated (cached), not admin
        with live.admin() as a:
            assert a.delete(f"/admin/keys/{key.json()['id']}").status_code == 200
        assert_openai_error(c.get("/admin/tenants"), 401)
    with live.admin() as a:
        keys = {k["id"]: k for k in a.get(f"/admin/tenants/{t['id']}").json()["keys"]}
    assert keys[t["key_id"]]["revoked_at"] is None and not keys[t["key_id"]]["revoked"]
    gone = keys[key.json()["id"]]
    assert gone["revoked"] and gone["revoked_at"].startswith("20")  # as `keys list` says it


def test_every_route_takes_one_kind_of_key(live):
    """Admin key on /admin/* and /metrics only, tenant keys everywhere else: each route, the
    wrong key is 403.

    Walks the app's own route table, so a route added later is checked too.
    """
    import re

    tenant = live.create_tenant("key-areas")
    checked = 0
    for route in live.app.routes:
        for handler in route.route_handlers:
            if handler.opt.get("exclude_from_auth"):
                continue
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            admin_route = path.startswith("/admin") or path == "/metrics"
            wrong_key = tenant["api_key"] if admin_route else ADMIN_KEY
            for method in sorted(handler.http_methods - {"HEAD", "OPTIONS"}):
                with live.client(wrong_key) as c:
                    response = c.request(method, path)
                code = "admin_only" if admin_route else "tenant_only"
                assert_openai_error(response, 403, code)
                checked += 1
    assert checked >= 12


def test_docs_open_without_a_key(live):
    """``/docs`` and the schema answer a browser (no key) and every key alike (issue 31).

    The page and the schema themselves: tests/gateway/test_docs.py.
    """
    tenant = live.create_tenant("reader")
    for key in (None, tenant["api_key"], live.admin_key):
        with live.client(key) as c:
            page = c.get("/docs")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            for path in ("/openapi.json", "/docs/openapi.json"):
                schema = c.get(path)
                assert schema.status_code == 200, (path, key)
                paths = schema.json()["paths"]
                assert {"/v1/chat/completions", "/v1/adapters", "/v1/models", "/v1/usage"} <= set(
                    paths
                )
