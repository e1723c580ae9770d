"""Structural bounds on structured-output specs (issue 27 item 1): every shape that crashed or
froze the engine core is refused before anything native runs, with a message naming the bound,
and the shapes real clients send (recursion, hundreds of properties, choices) pass."""

import json

import pytest

from loraplex.engine.structured_output.bounds import (
    DEFAULT_BOUNDS,
    BoundError,
    check_regex_bounds,
    check_schema_bounds,
)
from loraplex.engine.structured_output.grammar import StructuredOutputSpec


def chain(links: int, link: str) -> dict:
    """The issue's attack: ``links`` $defs, each pointing at the next through ``link``."""
    defs = {}
    for i in range(links):
        nxt = {"$ref": f"#/$defs/d{i + 1}"} if i + 1 < links else {"type": "integer"}
        defs[f"d{i}"] = {
            "anyOf": {"anyOf": [nxt, {"type": "integer"}]},
            "allOf": {"allOf": [nxt]},
            "oneOf": {"oneOf": [nxt, {"type": "string"}]},
            "items": {"type": "array", "items": nxt},
            "properties": {"type": "object", "properties": {"a": nxt}},
        }[link]
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("link", ["anyOf", "allOf", "oneOf", "items", "properties"])
def test_the_crashing_chains_are_refused_by_depth(link):
    schema = chain(900, link)  # inside the 64 KiB cap; 1,050 anyOf links killed the core
    with pytest.raises(BoundError, match="nests more than 64 levels"):
        check_schema_bounds(schema)
    with pytest.raises(ValueError, match="nests more than 64 levels"):
        StructuredOutputSpec.json_schema(schema).check_bounds()
    check_schema_bounds(chain(20, link))  # a short chain is an ordinary schema


def test_recursion_is_not_depth():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
            }
        },
        "$ref": "#/$defs/node",
    }
    check_schema_bounds(tree)
    check_schema_bounds({"$ref": "#"})  # refused later, by the sandbox: it allows no token


def test_depth_counts_plain_nesting_and_shared_subschemas():
    deep: dict = {"type": "integer"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    with pytest.raises(BoundError):
        check_schema_bounds(deep)
    # a subschema reached by many $refs is measured once, and still counts where it is used
    shared = {"$defs": {"leaf": deep["items"]["items"]}, "properties": {}}
    for i in range(50):
        shared["properties"][f"p{i}"] = {"$ref": "#/$defs/leaf"}
    with pytest.raises(BoundError):
        check_schema_bounds(shared)


def test_properties_and_enums():
    b = DEFAULT_BOUNDS
    one = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(400)}}
    check_schema_bounds(one)
    wide = {"type": "object", "properties": dict.fromkeys(range(b.max_object_properties + 1), {})}
    with pytest.raises(BoundError, match="401 properties; at most 400"):
        check_schema_bounds(wide)
    many = {"type": "object", "properties": {f"o{j}": one for j in range(6)}}
    check_schema_bounds(many)  # the same object six times is counted once
    distinct = {
        "type": "object",
        "properties": {f"o{j}": json.loads(json.dumps(one)) for j in range(6)},
    }
    with pytest.raises(BoundError, match="2048 properties in all"):
        check_schema_bounds(distinct)
    check_schema_bounds({"enum": list(range(1000))})
    with pytest.raises(BoundError, match="1000 enum values"):
        check_schema_bounds({"anyOf": [{"enum": list(range(600))}, {"enum": list(range(600))}]})


@pytest.mark.parametrize(
    "regex",
    [
        "a{1000000}",
        "((a{100}){100}){2}",
        "(ab|cd){5,20000}",
        "x{3}(y{200}){51}",
        "a{99999999999999999999999}",
        "(?:[a-z]{2}){10001}",
        "a{1000}{1000}",  # stacked repetitions multiply too
        "(?x)a{1 000 000}",  # the x flag allows whitespace inside the braces
        "(?x)(b{9999}) {9 9 9 9}",
        "a {100} {101}",
    ],
)
def test_regex_repetitions_past_the_bound(regex):
    with pytest.raises(BoundError, match="at most 10000"):
        check_regex_bounds(regex)
    with pytest.raises(ValueError):
        StructuredOutputSpec("regex", regex).check_bounds()


@pytest.mark.parametrize(
    "regex",
    [
        "a{10000}",
        "(a{100}){100}",
        r"\{1000000}",  # an escaped brace is a literal
        "[a{1000000}]",  # inside a class too
        r"\p{L}{5}\x{7F}{3}",
        "(yes|no)-[0-9]{3}",
        "a{,5}b{",  # not repetitions: the compiler judges them
        r"[\]{]{4}(a){2}",
        "a{100}|b{100}{100}",
        # inputs that made the first scanner quadratic (7 s for 64 KB): no repetition in them
        "{" * 32000 + "," * 32000 + "}",
        "{," * 32000 + "}",
    ],
    ids=lambda r: r[:24],
)
def test_regexes_within_the_bound(regex):
    check_regex_bounds(regex)


def test_id_and_anchor_references_are_followed():
    # a chain through $id-relative refs (llguidance resolves them; it SIGSEGVed at ~1,050)
    links = [
        {"$id": str(i), "anyOf": [{"$ref": str(i + 1)}, {"type": "integer"}]} for i in range(100)
    ]
    links.append({"$id": "100", "type": "integer"})
    schema = {"$id": "http://e/", "$ref": "0", "$defs": {"x": {"anyOf": links}}}
    with pytest.raises(BoundError, match="nests more than 64 levels"):
        check_schema_bounds(schema)
    short = {"$id": "http://e/", "$ref": "0", "$defs": {"x": {"anyOf": links[-20:]}}}
    short["$ref"] = "81"
    check_schema_bounds(short)
    anchored = {
        "$defs": {"node": {"$anchor": "node", "type": "array", "items": {"$ref": "#node"}}},
        "$ref": "#node",
    }
    check_schema_bounds(anchored)  # recursion through an anchor


def test_a_reference_the_bounds_cannot_follow_is_refused():
    for ref in ("http://elsewhere/schema.json", "#nowhere", "#/$defs/missing", "other.json#/x"):
        with pytest.raises(BoundError, match="names nothing within the schema"):
            check_schema_bounds({"$ref": ref})


def test_a_schema_pattern_is_a_regex_too():
    with pytest.raises(BoundError, match="a 'pattern' repeats"):
        check_schema_bounds({"type": "string", "pattern": "^(a{1000}){1000}$"})
    with pytest.raises(BoundError, match="'patternProperties' key"):
        check_schema_bounds({"type": "object", "patternProperties": {"^x{99999}$": {}}})


def test_the_check_is_linear_in_the_schema():
    # 1,000 objects that all $ref one another in a ring: every node is measured once
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{(i + 1) % 1000}"}]} for i in range(1000)}
    with pytest.raises(BoundError):
        check_schema_bounds({"$defs": defs, "$ref": "#/$defs/d0"})
    ring = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{(i + 1) % 30}"}]} for i in range(30)}
    check_schema_bounds({"$defs": ring, "$ref": "#/$defs/d0"})  # a short ring: recursion
