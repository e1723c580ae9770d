"""``POST /v1/responses`` through the ``openai`` SDK's ``client.responses`` on a live gateway:
text equal to the same conversation through chat, stored responses retrieved and deleted by
their tenant only, ``previous_response_id`` chains, usage billed once per response."""

import openai
import pytest

from tests.gateway.chat_support import engine_direct, usage_events

MODEL = "tiny-llava"


def test_text_response_equals_chat_and_is_billed_once(live, engine_client):
    tenant = live.create_tenant("acme")
    client = live.openai(tenant["api_key"])
    r = client.responses.create(
        model=MODEL,
        instructions="You are terse.",
        input="Name three rivers.",
        max_output_tokens=12,
        temperature=0,
        metadata={"run": "1"},
    )
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers."},
    ]
    direct = engine_direct(engine_client, messages, max_tokens=12, temperature=0.0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == direct.outputs[0].text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"]
    finish = direct.outputs[0].finish_reason
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == len(direct.prompt_token_ids)
    assert r.usage.output_tokens == len(direct.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.instructions == "You are terse." and r.metadata == {"run": "1"} and r.store

    [row] = usage_events(live, tenant["api_key"])
    assert row.request_id == r.id and row.status == "ok" and row.model == MODEL
    assert row.prompt_tokens == r.usage.input_tokens
    assert row.completion_tokens == r.usage.output_tokens

    # the same answer, as stored; gone once deleted
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_previous_response_id_continues_the_conversation(live, engine_client):
    client = live.openai(live.create_tenant("chain")["api_key"])
    first = client.responses.create(
        model=MODEL,
        input="Say a colour.",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Another one."}]}],
        max_output_tokens=6,
        temperature=0,
    )
    # the instructions of the first turn are not carried over (OpenAI's rule)
    messages = [
        {"role": "user", "content": "Say a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": [{"type": "text", "text": "Another one."}]},
    ]
    direct = engine_direct(engine_client, messages, max_tokens=6, temperature=0.0)
    assert second.previous_response_id == first.id
    assert second.output_text == direct.outputs[0].text
    assert second.usage.input_tokens == len(direct.prompt_token_ids)
    third = client.responses.create(
        model=MODEL,
        previous_response_id=second.id,
        input="And one more.",
        max_output_tokens=4,
        temperature=0,
    )
    assert third.usage.input_tokens > second.usage.input_tokens  # the whole chain is the prompt

    # store: false is answered but not kept: nothing to retrieve or continue
    loose = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert loose.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(loose.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=loose.id)
    assert err.value.body["param"] == "previous_response_id"


def test_another_tenants_response_is_a_404_everywhere(live):
    owner = live.openai(live.create_tenant("owner")["api_key"])
    thief_tenant = live.create_tenant("thief")
    thief = live.openai(thief_tenant["api_key"])
    r = owner.responses.create(model=MODEL, input="secret plans", max_output_tokens=3)
    unknown = "resp_" + "0" * 32
    for rid in (r.id, unknown, "resp_nope", "x" * 5000):
        with pytest.raises(openai.NotFoundError) as e1:
            thief.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError) as e2:
            thief.responses.delete(rid)
        with pytest.raises(openai.NotFoundError) as e3:
            thief.responses.create(model=MODEL, input="go on", previous_response_id=rid)
        # the same answer whether the id exists (another tenant's) or not
        assert e1.value.body["code"] == e2.value.body["code"] == "response_not_found"
        assert e3.value.body["param"] == "previous_response_id"
    assert owner.responses.retrieve(r.id).id == r.id  # untouched by the attempts
    # the refused continuation ran nothing: billed as errors with no tokens
    rows = usage_events(live, thief_tenant["api_key"])
    assert rows and all(row.status == "error" and row.prompt_tokens == 0 for row in rows)
