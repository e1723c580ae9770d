"""``tools`` / ``tool_choice`` through the ``openai`` SDK on a live gateway: forced calls
validate against their function's parameters (``jsonschema``), streamed or not; the template
renders the tools; a ``role: "tool"`` turn works; malformed tool use is a 400 naming it."""

import json

import jsonschema
import openai
import pytest

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow

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
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _required(client, seed, **kw):
    """One forced call (``parallel_tool_calls: false``), seeded: the same whatever the batch."""
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        parallel_tool_calls=False,
        seed=seed,
        temperature=1.0,
        **kw,
    )


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_validate(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=400,
        temperature=1.0,
        seed=1,
        n=2,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)
    one = _required(client, seed=3)
    assert len(one.choices[0].message.tool_calls) == 1
    named = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=300,
        seed=4,
        temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and named.choices[0].finish_reason == "tool_calls"
    _check_calls(calls, {"add"})


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_accumulate_as_openai_streams_them(client, choice):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=400,
        stream=True,
        seed=2,
        temperature=1.0,
    ):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += (d.function.name or "") if d.id else ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_tools_are_rendered_and_a_tool_turn_works(client):
    def prompt_tokens(**kw):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **kw)
        return r.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain  # not told of them
    assert prompt_tokens(tools=TOOLS, tool_choice="auto") > plain + 50
    auto = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=12
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    first = _required(client, seed=5)
    call = first.choices[0].message.tool_calls[0]
    turn = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=5)
    assert second.usage.prompt_tokens > prompt_tokens(tools=TOOLS) + 10  # the call and result
    assert second.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
            "tools[0].function.strict",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "string", "format": "no-such-format"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
    ],
)
def test_malformed_tool_use_is_400_naming_it(client, extra, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.body["param"] == param, err.value.body


# As LangChain's bind_tools sends a function's schema: no additionalProperties anywhere (issue 31:
# the model added keys the schema did not forbid until max_tokens cut the call).
OPEN_ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "where": {
            "type": "object",
            "properties": {"row": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
    "required": ["a"],
}
CLOSED_ADD = {
    **OPEN_ADD,
    "properties": {
        **OPEN_ADD["properties"],
        "where": {**OPEN_ADD["properties"]["where"], "additionalProperties": False},
    },
    "additionalProperties": False,
}
OPEN_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": OPEN_ADD}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_take_no_key_the_schema_does_not_list(client, choice):
    """The schema says nothing of additionalProperties: the arguments validate against it
    with ``additionalProperties: false`` on every object (OpenAI's strict mode)."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=OPEN_TOOLS,
        tool_choice=choice,
        max_tokens=200,
        temperature=1.0,
        seed=11,
        n=3,
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), CLOSED_ADD)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_call_cut_by_max_tokens_is_length_with_no_half_call(client, choice):
    body = dict(model=MODEL, messages=MESSAGES, tools=OPEN_TOOLS, tool_choice=choice, max_tokens=3)
    r = client.chat.completions.create(**body, n=2)
    for c in r.choices:
        assert c.finish_reason == "length"
        assert c.message.content is None and not c.message.tool_calls
    assert r.usage.completion_tokens == 6
    finish, content, arguments = None, "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                arguments += d.function.arguments or ""
    assert finish == "length" and content == ""
    if choice == "required":
        assert arguments == ""  # buffered: nothing of a cut call is sent
    else:  # streamed as it came, as OpenAI streams it; the finish reason says it is cut
        assert arguments and not arguments.endswith("}")
