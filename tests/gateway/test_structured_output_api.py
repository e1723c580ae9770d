"""``response_format`` and vLLM's ``guided_*`` through the ``openai`` SDK on a live gateway:
constrained outputs validate against their schema (``jsonschema``), streamed or not, with
``n`` > 1; a shape or schema that cannot be enforced is a 400 naming the field."""

import json
import re

import jsonschema
import openai
import pytest

# The slow tier: the fast tier (-m 'not slow and not service') must stay under two minutes.
pytestmark = pytest.mark.slow

MODEL = "tiny-llava"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
        "kind": {"enum": ["town", "village"]},
        "coords": {
            "type": "array",
            "items": {"type": "integer", "minimum": -90, "maximum": 90},
            "minItems": 2,
            "maxItems": 2,
        },
    },
    "required": ["city", "rank", "kind", "coords"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Name a place, as JSON."}]


def test_json_schema_plain_and_streamed(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=120,
        temperature=1.0,
        seed=4,
        n=3,
        response_format=FORMAT,
    )
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=120,
            temperature=1.0,
            seed=4,
            response_format=FORMAT,
            stream=True,
        )
        if chunk.choices
    )
    assert text == r.choices[0].message.content  # the same seed, the same first choice
    assert r.usage.completion_tokens > 0


def test_vllm_guided_fields(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"guided_choice": ["red & blue", "green?", "(none)"]},
    )
    assert r.choices[0].message.content in ("red & blue", "green?", "(none)")
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"},
    )
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        extra_body={"guided_json": json.dumps(SCHEMA)},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        response_format={"type": "text"},
        extra_body={"ignore_eos": True},  # an unseeded sample may draw EOS early
    )
    assert r.choices[0].finish_reason == "length"  # text is free: nothing constrained


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
        ),
        (  # valid JSON schema, but a keyword the grammar cannot enforce: refused at admission
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"if": {"type": "string"}, "then": {}}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=body
        )
    assert err.value.body["param"] == param, err.value.body


def test_an_in_process_core_compiles_grammars_with_the_fronts_tokenizer(engine_client):
    # One tokenizer per process: the core on a thread must not read the model's a second time.
    assert engine_client.core.engine_core.structured.hf_tokenizer is engine_client.tokenizer
