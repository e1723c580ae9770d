"""``POST /v1/responses`` through the ``openai`` SDK's ``client.responses`` on a live gateway:
text equal to the same conversation through chat, stored responses retrieved and deleted by
their tenant only, ``previous_response_id`` chains, usage billed once per response."""

import openai
import pytest
from openai.types.responses import Response

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

    # the same answer, as stored (valid for the SDK's pydantic type, not only its lenient
    # parser); gone once deleted
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    with live.client(tenant["api_key"]) as c:
        Response.model_validate(c.get(f"/v1/responses/{r.id}").json())
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


def test_streamed_events_are_what_the_sdk_expects(live):
    client = live.openai(live.create_tenant("streams")["api_key"])
    kwargs = {
        "model": MODEL,
        "input": "Tell me a story.",
        "max_output_tokens": 10,
        "temperature": 0,
    }
    plain = client.responses.create(**kwargs, store=False)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    last = "response.incomplete" if plain.status == "incomplete" else "response.completed"
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == plain.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.status == plain.status
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    # the stored response is the one the stream ended with
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()

    # the SDK's own accumulator (it checks every event against the state it builds)
    with client.responses.stream(**kwargs) as stream:
        seen = list(stream)
    assert seen[-1].response.output_text == plain.output_text

    rows = usage_events(live, client.api_key)
    assert len(rows) == 3 and all(r.status == "ok" for r in rows)
    assert rows[1].request_id == final.id


def test_the_tenants_adapter_by_name(live, engine_client, tiny_adapter):
    from tests.gateway.chat_support import register_adapter

    owner = live.create_tenant("owner")
    digest = register_adapter(live, owner["id"], "my-lora", tiny_adapter)
    client = live.openai(owner["api_key"])
    r = client.responses.create(
        model="my-lora", input="Describe it", max_output_tokens=6, temperature=0
    )
    messages = [{"role": "user", "content": "Describe it"}]
    direct = engine_direct(engine_client, messages, digest, max_tokens=6, temperature=0.0)
    assert r.model == "my-lora" and r.output_text == direct.outputs[0].text
    [row] = usage_events(live, owner["api_key"])
    assert (row.model, row.adapter_digest) == ("my-lora", digest)
    other = live.openai(live.create_tenant("other")["api_key"])
    with pytest.raises(openai.NotFoundError) as err:
        other.responses.create(model="my-lora", input="Describe it", max_output_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
