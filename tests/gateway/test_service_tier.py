"""``service_tier`` on every generation endpoint: ``flex`` runs in the engine's batch class and
says so, ``auto``/``default`` interactive, anything else a 400 naming ``service_tier``."""

import json

import openai
import pytest

from loraplex.engine.request import PRIORITY_BATCH, PRIORITY_INTERACTIVE

CHAT = {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny-llava", "prompt": "once", "max_tokens": 2}
RESPONSE = {"model": "tiny-llava", "input": "hi", "max_output_tokens": 2}
ROUTES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSE,
}
ASKED = [(None, "default", PRIORITY_INTERACTIVE), ("auto", "default", PRIORITY_INTERACTIVE)]
ASKED += [("default", "default", PRIORITY_INTERACTIVE), ("flex", "flex", PRIORITY_BATCH)]


@pytest.fixture
def priorities(live, monkeypatch):
    """The priority class of every engine request the gateway starts (a spy: it still runs)."""
    seen = []
    generate = live.state.engine.generate

    def spy(request, *args, **kwargs):
        seen.append(request.priority)
        return generate(request, *args, **kwargs)

    monkeypatch.setattr(live.state.engine, "generate", spy)
    return seen


def test_each_tier_runs_in_its_class_and_is_echoed(live, client, priorities):
    with live.client(client.api_key) as c:
        for route, base in ROUTES.items():
            for asked, echoed, priority in ASKED:
                body = dict(base) | ({} if asked is None else {"service_tier": asked})
                r = c.post(route, json=body)
                assert r.status_code == 200, r.text
                assert (route, r.json()["service_tier"]) == (route, echoed)
                assert priorities[-1] == priority
    assert len(priorities) == len(ASKED) * len(ROUTES)


def test_other_tiers_are_a_400_naming_service_tier(live, client, priorities):
    with live.client(client.api_key) as c:
        for route, base in ROUTES.items():
            for asked in ("priority", "scale", "", "FLEX", 1, True, "x" * 100_000):
                r = c.post(route, json=base | {"service_tier": asked})
                assert r.status_code == 400, (route, asked, r.text)
                error = r.json()["error"]
                assert error["param"] == "service_tier" and len(error["message"]) < 300
    assert priorities == []  # refused before anything ran


def test_streamed_chunks_and_events_say_flex(live, client, priorities):
    chunks = list(client.chat.completions.create(**CHAT, service_tier="flex", stream=True))
    assert chunks and {c.service_tier for c in chunks} == {"flex"}
    with live.client(client.api_key) as c:
        r = c.post("/v1/completions", json=COMPLETION | {"service_tier": "flex", "stream": True})
        lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: {")]
    assert lines and {json.loads(x)["service_tier"] for x in lines} == {"flex"}
    events = list(client.responses.create(**RESPONSE, service_tier="flex", stream=True))
    done = events[-1]
    assert done.type == "response.incomplete"  # max_output_tokens: 2
    assert done.response.service_tier == "flex"
    assert priorities == [PRIORITY_BATCH] * 3


def test_openai_sdk_sees_the_tier(client):
    chat = client.chat.completions.create(**CHAT, service_tier="flex")
    assert chat.service_tier == "flex"
    resp = client.responses.create(**RESPONSE, service_tier="flex")
    assert resp.service_tier == "flex"
    assert client.responses.retrieve(resp.id).service_tier == "flex"  # stored as served
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**RESPONSE, service_tier="priority")
    assert err.value.body["param"] == "service_tier"
