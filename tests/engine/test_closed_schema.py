"""Closed schemas for forced tool calls (engine/structured_output/closed_schema.py): objects
that do not say ``additionalProperties`` take no other keys, conjuncts stay as they are, closing
only narrows (``jsonschema`` is the oracle), rebased refs resolve, and the compiled grammar
closes the call after its last property."""

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from loraplex.engine.structured_output.closed_schema import close_objects, rebase_refs
from loraplex.engine.structured_output.grammar import (
    GrammarCompiler,
    StructuredOutputSpec,
    tokenizer_json,
)
from loraplex.gateway.domains.chat.tools import ToolRequest, arguments_schema

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
NESTED = {
    "type": "object",
    "properties": {
        "at": {"$ref": "#/$defs/Point", "description": "where (a sibling, not a conjunct)"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}},
        "meta": {"type": "object", "additionalProperties": True},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "either": {"anyOf": [POINT, {"type": "null"}]},
        "old": {"allOf": [{"$ref": "#/definitions/Unit"}]},  # pydantic v1's field form
    },
    "required": ["at"],
    "$defs": {"Point": POINT},
    "definitions": {"Unit": {"properties": {"u": {"enum": ["c", "f"]}}}},
}


def valid(schema, instance):
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_objects_without_additional_properties_are_closed_and_the_rest_kept():
    closed = close_objects(NESTED)
    assert "additionalProperties" not in NESTED  # the input is not changed
    good = {
        "at": {"x": 1},
        "path": [{"x": 2}],
        "meta": {"anything": [1, 2]},  # additionalProperties: true is kept
        "tags": {"k": "v"},
        "either": {"x": 3},
        "old": {"u": "c"},
    }
    assert valid(NESTED, good) and valid(closed, good)
    for extra in (
        {"at": {"x": 1}, "extra": 1},
        {"at": {"x": 1, "y": 2}},  # through a $ref with a sibling description
        {"at": {"x": 1}, "path": [{"x": 2, "y": 3}]},
        {"at": {"x": 1}, "either": {"x": 3, "y": 0}},
        {"at": {"x": 1}, "old": {"u": "c", "v": 1}},  # a single-member allOf is the member
    ):
        assert valid(NESTED, extra) and not valid(closed, extra), extra
    assert not valid(closed, {"at": {"x": 1}, "tags": {"k": 1}})  # its own schema still holds
    assert valid(close_objects({"type": "object"}), {}) is True
    assert not valid(close_objects({"type": "object"}), {"a": 1})  # OpenAI strict's reading


@pytest.mark.parametrize(
    "schema, instance",
    [
        # two conjuncts: closing either would forbid the other's keys
        (
            {"allOf": [POINT, {"properties": {"y": {"type": "integer"}}}]},
            {"x": 1, "y": 2},
        ),
        # an object that also takes keys from a $ref / anyOf
        (
            {
                "type": "object",
                "properties": {"y": {"type": "integer"}},
                "$ref": "#/$defs/P",
                "$defs": {"P": POINT},
            },
            {"x": 1, "y": 2},
        ),
        (
            {
                "type": "object",
                "properties": {"y": {"type": "integer"}},
                "anyOf": [POINT],
            },
            {"x": 1, "y": 2},
        ),
        # under not: closing would widen what the schema allows
        ({"type": "object", "not": {"properties": {"bad": {}}, "required": ["bad"]}}, {}),
    ],
)
def test_conjuncts_and_negations_keep_what_the_schema_allows(schema, instance):
    closed = close_objects(schema)
    assert valid(schema, instance) and valid(closed, instance)
    if "not" in schema:
        assert closed["not"] == schema["not"]
        assert not valid(closed, {"bad": 1}) and not valid(closed, {"other": 1})


def test_rebased_refs_resolve_inside_another_document():
    inner = {**NESTED, "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x:y"}
    wrapper = {"properties": {"p": {"$ref": "#/$defs/t0"}}, "$defs": {"t0": None}}
    wrapper["$defs"]["t0"] = rebase_refs(inner, "/$defs/t0")
    assert wrapper["$defs"]["t0"]["properties"]["at"]["$ref"] == "#/$defs/t0/$defs/Point"
    assert "$id" not in wrapper["$defs"]["t0"] and "$id" in inner
    assert valid(wrapper, {"p": {"at": {"x": 1}}})
    assert not valid(wrapper, {"p": {"at": {"x": "one"}}})  # the Point schema is applied
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    assert rebase_refs(recursive, "/$defs/t1")["properties"]["child"]["$ref"] == "#/$defs/t1"


def test_the_required_form_holds_each_tool_closed_under_its_own_defs():
    tools = ToolRequest(tools=[], parameters={"f": NESTED, "g": POINT}, mode="required")
    schema = json.loads(tools.structured_output().value)
    call = {"name": "f", "parameters": {"at": {"x": 1}, "path": [{"x": 2}]}}
    assert valid(schema, [call, {"name": "g", "parameters": {"x": 5}}])
    assert not valid(schema, [{"name": "g", "parameters": {"x": 5, "y": 1}}])
    assert not valid(schema, [{"name": "f", "parameters": {"at": {"x": 1, "y": 2}}}])
    assert not valid(schema, [{"name": "f", "parameters": {"at": {"x": 1}}, "extra": 0}])
    assert not valid(schema, [])


@pytest.fixture(scope="module")
def compiler(tiny_text_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_dir)
    return GrammarCompiler(tokenizer_json(tokenizer), len(tokenizer), (tokenizer.eos_token_id,))


def test_the_grammar_closes_the_call_after_its_last_property(compiler):
    """At ``{"x":1`` a forced call's closed object allows ``}`` (or more digits) and no other
    key; one whose schema allows more keys (``additionalProperties: true``) still takes them."""
    silent = {"type": "object", "properties": {"x": {"type": "integer"}}}
    allows = {**silent, "additionalProperties": True}
    tokens = compiler.tokenizer
    prefix = tokens.tokenize_str('{"x":1')
    cases = ((silent, True), (arguments_schema(silent), False), (arguments_schema(allows), True))
    for schema, comma_allowed in cases:
        matcher = compiler.matcher(StructuredOutputSpec.json_schema(schema))
        assert matcher.consume_tokens(prefix)
        comma = tokens.tokenize_str(',"')
        assert (matcher.validate_tokens(comma) == len(comma)) is comma_allowed
        assert matcher.consume_tokens(tokens.tokenize_str("}"))
        assert matcher.is_accepting()
