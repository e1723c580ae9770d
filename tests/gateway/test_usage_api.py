"""``GET /v1/usage``: the contract's shape, the caller's tenant only, ``since`` / ``until``."""

from datetime import UTC, datetime, timedelta, timezone

from tests.gateway.test_app_basics import assert_openai_error

MODEL = "tiny-llava"
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "images")


def chat(live, key, model=MODEL, max_tokens=3):
    with live.client(key) as c:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        return c.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens})


def usage(live, key, **params):
    with live.client(key) as c:
        return c.get("/v1/usage", params=params)


def test_usage_shape_isolation_and_time_window(live):
    a = live.create_tenant("alpha")
    b = live.create_tenant("beta")
    empty = usage(live, a["api_key"]).json()
    assert empty == {
        "object": "usage",
        "tenant": a["id"],
        "totals": dict.fromkeys(FIELDS, 0),
        "by_model": [],
    }

    before = datetime.now(UTC) - timedelta(seconds=1)
    r1 = chat(live, a["api_key"]).json()["usage"]
    r2 = chat(live, a["api_key"], max_tokens=5).json()["usage"]
    assert chat(live, a["api_key"], model="no-such-model").status_code == 404
    rb = chat(live, b["api_key"]).json()["usage"]

    got = usage(live, a["api_key"]).json()
    assert set(got) == {"object", "tenant", "totals", "by_model"}
    assert got["tenant"] == a["id"]
    base = {
        "model": MODEL,
        "requests": 2,
        "prompt_tokens": r1["prompt_tokens"] + r2["prompt_tokens"],
        "completion_tokens": r1["completion_tokens"] + r2["completion_tokens"],
        "cached_tokens": r1["prompt_tokens_details"]["cached_tokens"]
        + r2["prompt_tokens_details"]["cached_tokens"],
        "images": 0,
    }
    missing = {"model": "no-such-model", "requests": 1, **dict.fromkeys(FIELDS[1:], 0)}
    assert got["by_model"] == sorted([base, missing], key=lambda m: m["model"])
    assert got["totals"] == {f: base[f] + missing[f] for f in FIELDS}

    # beta sees only its own request
    got_b = usage(live, b["api_key"]).json()
    assert got_b["totals"]["requests"] == 1
    assert got_b["totals"]["prompt_tokens"] == rb["prompt_tokens"]

    # the window: [since, until), ISO 8601 with Z, offsets or naive (UTC)
    after = datetime.now(UTC) + timedelta(seconds=1)
    assert usage(live, a["api_key"], since=before.isoformat()).json()["totals"]["requests"] == 3
    in_window = usage(
        live,
        a["api_key"],
        since=before.strftime("%Y-%m-%dT%H:%M:%SZ"),
        until=after.astimezone(timezone(timedelta(hours=2))).isoformat(),
    ).json()
    assert in_window["totals"] == got["totals"]
    assert usage(live, a["api_key"], since=after.isoformat()).json()["by_model"] == []
    naive_past = (before - timedelta(hours=1)).replace(tzinfo=None).isoformat()
    assert usage(live, a["api_key"], until=naive_past).json()["totals"]["requests"] == 0


def test_usage_errors(live):
    tenant = live.create_tenant("errs")
    for name in ("since", "until"):
        err = assert_openai_error(usage(live, tenant["api_key"], **{name: "yesterday"}), 400)
        assert err["param"] == name and "ISO 8601" in err["message"]
    assert_openai_error(usage(live, None), 401)
    assert_openai_error(usage(live, "lpx-unknown-key"), 401)
    assert_openai_error(usage(live, live.admin_key), 403)
