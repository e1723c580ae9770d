"""No response ends before its usage row is durable (issue 13, item 6), on a live gateway.

The spool's append is held (as a slow disk would hold it): the JSON body, and a stream's last
chunk and ``[DONE]``, must not arrive until it returns. When neither the spool nor the database
can take the row, the client gets 503 ``usage_unavailable`` (an error event in a stream)
instead of an answer it would take as complete.
"""

import json
import threading
import time

import httpx
import pytest

from tests.gateway.live import instant_gateway
from tests.gateway.test_app_basics import assert_openai_error
from tests.gateway.test_db_unavailable import DeadSessions

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]


def hold_spool(gw):
    """Make the spool's sync wait for the returned event; returns (event, calls)."""
    spool = gw.state.usage._spool
    release, calls = threading.Event(), []
    sync = spool.sync

    def held(segment):
        calls.append(segment.last_seq)
        release.wait(30)
        sync(segment)

    spool.sync = held
    return release, calls


def test_the_json_body_waits_for_the_spool(tmp_path):
    with instant_gateway(tmp_path / "data") as gw:
        key = gw.create_tenant("wait")["api_key"]
        release, calls = hold_spool(gw)
        result = {}

        def ask():
            body = {"model": "instant", "messages": HI}
            with gw.client(key) as c:
                result["r"] = c.post("/v1/chat/completions", json=body)

        asker = threading.Thread(target=ask)
        asker.start()
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert calls and "r" not in result  # generated, not durable: no body yet
        release.set()
        asker.join(10)
        assert result["r"].status_code == 200, result["r"].text


def test_the_last_chunk_and_done_wait_for_the_spool(tmp_path):
    with instant_gateway(tmp_path / "data") as gw:
        key = gw.create_tenant("wait")["api_key"]
        release, calls = hold_spool(gw)
        body = {"model": "instant", "messages": HI, "stream": True, "max_tokens": 4}
        seen = []

        def read():
            with httpx.Client(base_url=gw.base_url, timeout=30) as c:
                headers = {"Authorization": f"Bearer {key}"}
                with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status_code == 200
                    seen.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        before = list(seen)
        release.set()
        reader.join(10)
        assert calls  # the run finished and its row went to the spool
        assert "[DONE]" not in before
        assert not any(json.loads(e)["choices"][0].get("finish_reason") for e in before)
        assert seen[-1] == "[DONE]"
        finishes = [json.loads(e)["choices"] for e in seen[:-1]]
        assert any(c and c[0]["finish_reason"] == "length" for c in finishes)


def test_no_durable_place_for_the_row_is_a_503_not_an_answer(tmp_path):
    with instant_gateway(tmp_path / "data") as gw:
        key = gw.create_tenant("nowhere")["api_key"]
        writer = gw.state.usage

        def disk_full(data, last_seq):
            raise OSError(28, "No space left on device")

        writer._spool.write = disk_full
        writer._sessions = DeadSessions(ConnectionRefusedError("database down"))
        with gw.client(key) as c:
            r = c.post("/v1/chat/completions", json={"model": "instant", "messages": HI})
            assert_openai_error(r, 503)
            assert r.json()["error"]["code"] == "usage_unavailable"
            assert r.headers["retry-after"] == "2"
            stream = c.post(
                "/v1/chat/completions",
                json={"model": "instant", "messages": HI, "stream": True},
            )
        events = [e[6:] for e in stream.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "usage_unavailable"
        assert writer.pending == 2  # kept: written if the database comes back
        writer._sessions = gw.state.sessions
        writer._urgent.set()
        writer._wake.set()
        deadline = time.monotonic() + 10
        while writer.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.pending == 0
