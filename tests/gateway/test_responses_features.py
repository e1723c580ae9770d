"""The Responses API's function tools, ``text.format``, image input and refusals, through the
``openai`` SDK on a live gateway: calls validate against their schema (``jsonschema``) and
round-trip through ``function_call_output``; structured text validates; an image equals the
same chat; what is not supported is a 400 naming the field."""

import json

import jsonschema
import openai
import pytest

from tests.gateway.chat_support import data_url, engine_direct, image_part, photo, user

MODEL = "tiny-llava"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
PLACE = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def test_function_tool_round_trip_plain_and_streamed(client):
    r = client.responses.create(
        model=MODEL,
        input="What is the weather in Oslo?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=1.0,
    )
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    # the result goes back as function_call_output, continuing the stored response
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=5,
    )
    assert answer.output[0].type == "message"
    # ... or with the whole conversation resent, as a client without storage does
    resent = client.responses.create(
        model=MODEL,
        store=False,
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "12 C"},
        ],
        max_output_tokens=5,
    )
    assert resent.usage.input_tokens == answer.usage.input_tokens  # the same prompt

    # a named function, streamed: arguments deltas, checked by the SDK's accumulator
    with client.responses.stream(
        model=MODEL,
        input="Weather?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    [item] = final.output
    assert item.type == "function_call" and item.arguments == done.arguments
    jsonschema.validate(json.loads(item.arguments), WEATHER)


def test_text_format_json_schema_and_json_object(client):
    r = client.responses.create(
        model=MODEL,
        input="Name a place, as JSON.",
        text={"format": {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}},
        max_output_tokens=100,
        temperature=1.0,
    )
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), PLACE)
    streamed = "".join(
        e.delta
        for e in client.responses.create(
            model=MODEL,
            input="Name a place, as JSON.",
            text={"format": {"type": "json_schema", "name": "place", "schema": PLACE}},
            max_output_tokens=100,
            stream=True,
        )
        if e.type == "response.output_text.delta"
    )
    jsonschema.validate(json.loads(streamed), PLACE)
    # json_object: the random tiny model writes one long key, so only its start is checkable
    obj = client.responses.create(
        model=MODEL,
        input="JSON please.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=8,
        temperature=0,
    )
    assert obj.text.format.type == "json_object" and obj.output_text.startswith('{"')
    free = client.responses.create(
        model=MODEL, input="JSON please.", max_output_tokens=8, temperature=0
    )
    assert not free.output_text.startswith("{")  # without the format, the model writes no JSON
    with pytest.raises(openai.BadRequestError) as err:  # a schema shape the chat path refuses
        client.responses.create(
            model=MODEL, input="x", text={"format": {"type": "json_schema", "schema": PLACE}}
        )
    assert err.value.body["param"] == "text.format.name"


def test_image_input_equals_the_same_chat(live, engine_client):
    client = live.openai(live.create_tenant("pics")["api_key"])
    url = data_url(photo("astronaut", 96))
    r = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                    {"type": "input_text", "text": "What is in this picture?"},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
    )
    messages = [user(image_part(url), "What is in this picture?")]
    direct = engine_direct(engine_client, messages, max_tokens=8, temperature=0.0)
    assert r.output_text == direct.outputs[0].text
    assert r.usage.input_tokens == len(direct.prompt_token_ids) > 64  # the image's tokens


def _refused(client, param, **body):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": MODEL, "input": "hi", **body})
    assert err.value.body["param"] == param, err.value.body
    return err.value.body


def test_unsupported_and_hostile_requests_are_400s_naming_the_field(live):
    client = live.openai(live.create_tenant("hostile")["api_key"])
    max_items = live.state.engine.max_model_len
    _refused(client, "input", input=[{"role": "user", "content": "a"}] * (max_items + 1))
    _refused(client, "input[1].type", input=[{"role": "user", "content": "a"}, {"type": "x"}])
    _refused(client, "input[0].type", input=[{"type": "item_reference", "id": "msg_1"}])
    _refused(client, "input[0].type", input=[{"type": "reasoning", "summary": []}])
    _refused(client, "input[0].content[0].type", input=[user({"type": "input_file"})])
    _refused(client, "input[0].content[0].text", input=[user({"type": "input_text", "text": {}})])
    _refused(client, "input[0].role", input=[{"role": "tool", "content": "x"}])
    _refused(client, "input[0].bogus", input=[{"role": "user", "content": "x", "bogus": 1}])
    _refused(
        client,
        "input[0].content[0].image_url",
        input=[user({"type": "input_image", "image_url": "https://example.com/a.png"})],
    )
    _refused(
        client,
        "input[0].content[0].detail",
        input=[user({"type": "input_image", "image_url": "data:,", "detail": "high"})],
    )
    _refused(
        client,
        "input[0].arguments",
        input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
    )
    _refused(client, "tools[0].type", tools=[{"type": "web_search"}])
    _refused(client, "tools[0].type", tools=[{"type": "file_search", "vector_store_ids": []}])
    _refused(client, "tool_choice.type", tools=TOOLS, tool_choice={"type": "web_search_preview"})
    _refused(client, "background", background=True)
    _refused(client, "reasoning.effort", reasoning={"effort": "high"})
    _refused(client, "include", include=["message.output_text.logprobs"])
    _refused(client, "truncation", truncation="auto")
    _refused(client, "top_logprobs", top_logprobs=2)
    _refused(client, "text.verbosity", text={"verbosity": "low"})
    _refused(client, "conversation", conversation="conv_1")
    _refused(client, "max_output_tokens", max_output_tokens=10**6)
    _refused(client, "temperature", temperature=-1)
    _refused(client, "metadata", metadata={f"k{i}": "v" for i in range(17)})
    _refused(client, "something_else", extra_body={"something_else": 1})
    _refused(client, "input", input=[])
    with live.client(client.api_key) as c:
        deep = b'{"model": "tiny-llava", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = c.post("/v1/responses", content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.get("/v1/responses/resp_" + "0" * 32, params={"stream": "true"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    # still serving
    assert client.responses.create(model=MODEL, input="ok", max_output_tokens=1).usage


def test_stored_responses_are_bounded_per_tenant(live, monkeypatch):
    from loraplex.gateway.domains.responses import store

    client = live.openai(live.create_tenant("hoarder")["api_key"])
    other = live.openai(live.create_tenant("neighbour")["api_key"])
    kept = other.responses.create(model=MODEL, input="mine", max_output_tokens=1)
    monkeypatch.setattr(store, "MAX_PER_TENANT", 2)
    ids = [
        client.responses.create(model=MODEL, input="x", max_output_tokens=1).id for _ in range(3)
    ]
    with pytest.raises(openai.NotFoundError):  # the oldest made room
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    assert other.responses.retrieve(kept.id).id == kept.id  # another tenant's are not touched

    monkeypatch.setattr(store, "MAX_STORED_BYTES", 2048)
    body = _refused(client, "store", input="x" * 3000, max_output_tokens=1)
    assert "store" in body["message"]
    assert client.responses.create(model=MODEL, input="x" * 3000, max_output_tokens=1, store=False)
