"""``response_format`` ``json_schema`` with ``strict: true``: closed as OpenAI's strict mode,
refused where strict mode cannot take the schema; ``jsonschema`` is the oracle."""

import copy
import json

import jsonschema
import openai
import pytest

from loraplex.gateway.domains.chat.response_format import parse_structured_output
from loraplex.gateway.errors import APIError

WHERE = "response_format.json_schema.schema"
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
        "tags": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"t": {"type": "integer"}},
                "required": ["t"],
            },
        },
        "alt": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/point"}]},
    },
    "required": ["name", "home", "tags", "alt"],
    "$defs": {
        "point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    },
}


def fmt(schema, strict=True):
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema, "strict": strict},
        }
    }


def enforced(body):
    spec, _ = parse_structured_output(body)
    return json.loads(spec.value)


def valid(schema, instance):
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_strict_closes_every_object_and_only_narrows():
    original = copy.deepcopy(NESTED)
    closed = enforced(fmt(NESTED))
    assert NESTED == original  # the request's own schema is not changed
    jsonschema.Draft202012Validator.check_schema(closed)
    good = {"name": "a", "home": {"city": "b"}, "tags": [{"t": 1}], "alt": {"x": 2}}
    extras = [
        good | {"extra": 1},
        good | {"home": {"city": "b", "zip": "1"}},
        good | {"tags": [{"t": 1, "u": 2}]},
        good | {"alt": {"x": 2, "y": 3}},  # under a $ref into $defs
    ]
    assert valid(closed, good) and valid(NESTED, good)
    for instance in extras:  # JSON Schema lets each through; strict mode does not
        assert valid(NESTED, instance) and not valid(closed, instance), instance
    for instance in [good, *extras, {"name": "a"}, good | {"tags": "x"}]:
        assert not valid(closed, instance) or valid(NESTED, instance)  # closed => original


def test_without_strict_the_schema_is_enforced_as_written():
    assert enforced(fmt(NESTED, strict=False)) == NESTED
    assert enforced(fmt(NESTED, strict=None)) == NESTED


def test_a_property_named_like_a_keyword_is_a_name():
    schema = {"type": "object", "properties": {"not": {"type": "string"}}, "required": ["not"]}
    assert enforced(fmt(schema))["additionalProperties"] is False


def obj(**props):
    return {"type": "object", "properties": props, "required": list(props)}


@pytest.mark.parametrize(
    ("schema", "at", "says"),
    [
        ({"type": "array", "items": {"type": "string"}}, "/", "root"),
        ({"type": "object", "anyOf": [obj(a={"type": "string"})]}, "/", "root"),
        (obj(a={"allOf": [obj(b={"type": "string"})]}), "/properties/a", "allOf"),
        (obj(a={"not": {"type": "string"}}), "/properties/a", "not"),
        (obj(a={"type": "string", "if": {}, "then": {}}), "/properties/a", "if"),
        (obj(a=obj(b={"type": "string"}) | {"additionalProperties": True}), "/properties/a", ""),
        (
            obj(a={"type": "object", "additionalProperties": {"type": "string"}}),
            "/properties/a",
            "",
        ),
        ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"]}, "/", "'b'"),
        (
            obj(a={"type": "array", "items": obj(b={}) | {"required": []}}),
            "/properties/a/items",
            "",
        ),
        (
            obj(a={"$ref": "#/$defs/d"}) | {"$defs": {"d": {"patternProperties": {}}}},
            "/$defs/d",
            "",
        ),
        (obj(a={"type": "array", "contains": {"type": "string"}}), "/properties/a", "contains"),
        (obj(a={"type": "object", "minProperties": 1}), "/properties/a", "minProperties"),
    ],
)
def test_schemas_strict_mode_cannot_take_are_a_400(schema, at, says):
    with pytest.raises(APIError) as err:
        enforced(fmt(schema))
    assert err.value.status == 400 and err.value.param == WHERE
    assert f"at '{at}'" in err.value.message and says in err.value.message
    enforced(fmt(schema, strict=False))  # without strict the same schema is taken (or not) as is


def test_through_the_openai_sdk(client):
    schema = {
        "type": "object",
        "properties": {"city": obj(name={"type": "string", "maxLength": 6})},
        "required": ["city"],
    }
    closed = enforced(fmt(schema))
    r = client.chat.completions.create(
        model="tiny-llava",
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=60,
        seed=3,
        n=3,
        **fmt(schema),
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), closed)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-llava",
            messages=[{"role": "user", "content": "JSON"}],
            **fmt(obj(a={}) | {"required": []}),
        )
    assert err.value.body["param"] == WHERE
    with pytest.raises(openai.BadRequestError) as err:  # the Responses API names its own field
        client.responses.create(
            model="tiny-llava",
            input="JSON",
            text={
                "format": {
                    "type": "json_schema",
                    "name": "s",
                    "schema": {"type": "array"},
                    "strict": True,
                }
            },
        )
    assert err.value.body["param"] == "text.format.schema"
