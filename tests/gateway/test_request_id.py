"""``x-request-id`` on every response (issue 31): the client's valid one echoed, else a new one.

One live gateway over the instant engine serves every test here (uvicorn with the gateway's
HTTP protocol, as ``serve`` runs it), so the transport's own refusals are covered too.
"""

import asyncio
import json
import re

import httpx
import pytest
from sqlalchemy import select

from loraplex.gateway.db.models import UsageEvent
from loraplex.gateway.server.metrics_listener import MetricsApp
from loraplex.gateway.transport import request_id
from tests.gateway.conftest import with_db
from tests.gateway.live import ADMIN_KEY, LiveGateway
from tests.gateway.test_app_basics import assert_openai_error
from tests.gateway.transport_support import closed_by_server, connect, read_response

GENERATED = re.compile(r"[0-9a-f]{32}")
HI = {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    from bench.fake_engine import InstantEngine

    engine = InstantEngine("instant")
    data = tmp_path_factory.mktemp("reqid") / "data"
    with LiveGateway(engine, data, max_header_bytes=4096, chat_max_body_bytes=MAX_BODY) as live:
        live.key = live.create_tenant("acme")["api_key"]
        yield live
    assert engine.in_flight == 0


# ---------------------------------------------------------------- the id itself
@pytest.mark.parametrize(
    ("sent", "valid"),
    [
        (b"abc", True),
        (b"req-7f3a/2026-01-01T00:00:00Z:#1", True),
        (b"x" * 64, True),
        (b"!~", True),
        (b"x" * 65, False),
        (b"", False),
        (b"has space", False),
        (b"tab\there", False),
        (b"caf\xc3\xa9", False),
        (b"del\x7f", False),
        (b"nul\x00", False),
        (b"line\r\nset-cookie: a=b", False),
    ],
)
def test_a_client_id_is_taken_only_when_valid(sent, valid):
    scope = {"type": "http", "headers": [(b"host", b"x"), (b"x-request-id", sent)]}
    assert request_id.client_id(scope) == (sent.decode() if valid else None)
    rid = request_id.request_id(scope)
    assert rid == sent.decode() if valid else GENERATED.fullmatch(rid)
    assert request_id.request_id(scope) == rid  # made once per request


def test_the_first_header_counts_and_none_means_a_new_id_each_time():
    two = {"headers": [(b"x-request-id", b"first"), (b"x-request-id", b"second")]}
    assert request_id.request_id(two) == "first"
    bad_first = {"headers": [(b"x-request-id", b"a b"), (b"x-request-id", b"ok")]}
    assert request_id.client_id(bad_first) is None
    ids = {request_id.request_id({"headers": []}) for _ in range(100)}
    assert len(ids) == 100 and all(GENERATED.fullmatch(i) for i in ids)


def test_a_response_that_names_its_id_keeps_it_and_the_apps_list_is_left_alone():
    scope = {"type": "http", "headers": [(b"x-request-id", b"mine")]}
    shared = [(b"content-type", b"text/plain")]
    message = {"type": "http.response.start", "status": 200, "headers": shared}
    request_id.tag_response(message, scope)
    assert message["headers"] == [*shared, (b"x-request-id", b"mine")]
    assert shared == [(b"content-type", b"text/plain")]
    own = {"type": "http.response.start", "headers": [(b"X-Request-Id", b"app")]}
    request_id.tag_response(own, scope)
    assert own["headers"] == [(b"X-Request-Id", b"app")]
    body = {"type": "http.response.body", "body": b""}
    request_id.tag_response(body, scope)
    assert "headers" not in body


def test_the_metrics_listener_tags_its_answers():
    sent = []

    async def send(message):
        sent.append(message)

    async def main():
        app = MetricsApp(lambda: b"x 1\n")
        for path in ("/metrics", "/v1/models"):
            headers = [(b"x-request-id", b"scrape-1")]
            scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
            await app(scope, None, send)

    asyncio.run(main())
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [200, 404]
    assert all((b"x-request-id", b"scrape-1") in m["headers"] for m in starts)


# ------------------------------------------------------------------ live answers
def answers(gw, headers):
    """One response of each kind the app gives: (what, response)."""
    tenant = {"Authorization": f"Bearer {gw.key}", **headers}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}", **headers}
    out = []
    with httpx.Client(base_url=gw.base_url, timeout=30) as c:
        out.append(("health", c.get("/health", headers=headers)))
        out.append(("version", c.get("/version", headers=headers)))
        out.append(("no key", c.get("/v1/models", headers=headers)))
        out.append(("admin key on a tenant route", c.get("/v1/models", headers=admin)))
        out.append(("tenant key on /metrics", c.get("/metrics", headers=tenant)))
        out.append(("metrics", c.get("/metrics", headers=admin)))
        out.append(("no route", c.get("/v1/nothing", headers=tenant)))
        out.append(("method", c.delete("/health", headers=headers)))
        out.append(("models", c.get("/v1/models", headers=tenant)))
        bad = c.post("/v1/chat/completions", content=b"{nope", headers=tenant)
        out.append(("bad json", bad))
        big = c.post("/v1/chat/completions", content=b"x" * (MAX_BODY + 1), headers=tenant)
        out.append(("too large", big))
        out.append(("chat", c.post("/v1/chat/completions", json=HI, headers=tenant)))
        stream = {**HI, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=stream, headers=tenant) as r:
            r.read()
            out.append(("stream", r))
        out.append(("completion", c.post("/v1/completions", json=COMPLETION, headers=tenant)))
    return out


COMPLETION = {"model": "instant", "prompt": "hi", "max_tokens": 2}
STATUSES = [200, 200, 401, 403, 403, 200, 404, 405, 200, 400, 413, 200, 200, 200]


def test_a_valid_client_id_is_echoed_on_every_answer(gw):
    got = answers(gw, {"X-Request-Id": "trace-42/a:b"})
    assert [r.status_code for _, r in got] == STATUSES, [(w, r.text[:200]) for w, r in got]
    for what, r in got:
        assert r.headers.get_list("x-request-id") == ["trace-42/a:b"], what


def test_without_one_each_answer_gets_a_new_id(gw):
    got = answers(gw, {})
    assert [r.status_code for _, r in got] == STATUSES
    ids = [r.headers["x-request-id"] for _, r in got]
    assert all(GENERATED.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)
    by_what = dict(got)
    # the server's id of an executed request ends with it: response id, chunk ids, usage row
    chat = by_what["chat"]
    assert chat.json()["id"] == "chatcmpl-" + chat.headers["x-request-id"]
    assert (
        by_what["completion"].json()["id"]
        == "cmpl-" + by_what["completion"].headers["x-request-id"]
    )
    stream = by_what["stream"]
    chunks = [json.loads(ln[6:]) for ln in stream.text.splitlines() if ln[6:7] == "{"]
    assert {c["id"] for c in chunks} == {"chatcmpl-" + stream.headers["x-request-id"]}


@pytest.mark.parametrize("sent", ["has space", "x" * 65, "", "t\tab"])
def test_an_invalid_id_is_replaced_never_echoed(gw, sent):
    with gw.client(gw.key) as c:
        r = c.get("/v1/models", headers={"X-Request-Id": sent})
        assert r.status_code == 200
        assert GENERATED.fullmatch(r.headers["x-request-id"])
        # the billed routes refuse it (it would go into the usage row), still with a new id
        r = c.post("/v1/chat/completions", json=HI, headers={"X-Request-Id": sent})
    assert assert_openai_error(r, 400)["param"] == "X-Request-Id"
    assert GENERATED.fullmatch(r.headers["x-request-id"])


def raw(gw, request: bytes) -> tuple[int, dict, bytes]:
    sock = connect(gw)
    sock.sendall(request)
    answer = read_response(sock)
    sock.close()
    return answer


def test_non_ascii_and_injected_ids_cannot_reach_the_response(gw):
    key = gw.key.encode()
    for value, status in ((b"caf\xc3\xa9", 200), (b"\xff", 200), (b"nul\x01", 400)):
        got, headers, _ = raw(
            gw,
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + key + b"\r\n"
            b"x-request-id: " + value + b"\r\nconnection: close\r\n\r\n",
        )
        # a control byte is refused by the parser (400, OpenAI's body), others not echoed
        assert got == status and GENERATED.fullmatch(headers["x-request-id"]), value
    # a CR LF inside a value ends the header: the rest is a malformed header line (400)
    status, headers, body = raw(
        gw,
        b"GET /health HTTP/1.1\r\nhost: x\r\nx-request-id: a\rset-cookie: s=1\r\n\r\n",
    )
    assert status == 400 and "set-cookie" not in headers
    assert GENERATED.fullmatch(headers["x-request-id"])
    assert json.loads(body)["error"]["code"] == "invalid_http_request"


def test_the_transports_own_refusals_carry_an_id(gw):
    sock = connect(gw)
    filler = b"x-pad: " + b"p" * 5000 + b"\r\n"
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-request-id: mine\r\n" + filler + b"\r\n")
    status, headers, body = read_response(sock)
    assert status == 431 and json.loads(body)["error"]["code"] == "header_too_large"
    # a head refused is not believed: its id is a new one
    assert GENERATED.fullmatch(headers["x-request-id"])
    assert closed_by_server(sock)


def test_the_usage_row_names_the_same_request(gw):
    with gw.client(gw.key) as c:
        mine = c.post("/v1/chat/completions", json=HI, headers={"X-Request-Id": "job-7:row-1"})
        theirs = c.post("/v1/chat/completions", json=HI)
        assert c.get("/v1/usage").status_code == 200  # writes what is queued first

    async def rows(sessions):
        async with sessions() as s:
            found = await s.execute(select(UsageEvent.request_id, UsageEvent.client_request_id))
            return {row.request_id: row.client_request_id for row in found}

    by_id = with_db(gw.state.config.db_url, rows)
    assert by_id[mine.json()["id"]] == "job-7:row-1" == mine.headers["x-request-id"]
    generated = theirs.headers["x-request-id"]
    assert by_id[f"chatcmpl-{generated}"] is None
