"""``response_format`` ``json_schema`` with ``strict: true``: OpenAI's strict mode.

OpenAI's Structured Outputs take, under ``strict: true``, a subset of JSON Schema (OpenAI's
guide, "Supported schemas"): the root is an object schema (not an ``anyOf``); every object has
``additionalProperties: false`` and lists every one of its ``properties`` in ``required``
(an optional field is written as a nullable type); and the composition and object/array
keywords a grammar cannot enforce exactly are refused (``allOf``, ``not``, ``if`` / ``then`` /
``else``, ``dependentRequired``, ``dependentSchemas``, ``patternProperties``,
``unevaluatedProperties``, ``unevaluatedItems``, ``propertyNames``, ``minProperties``,
``maxProperties``, ``contains``, ``minContains``, ``maxContains``). OpenAI refuses such a
schema with a 400; so does :func:`strict_schema`, naming the place in the schema.

An object that does not say ``additionalProperties`` is closed here (given ``false``, with
``engine.structured_output.closed_schema.close_objects``, the same closing forced tool calls
use) rather than refused as OpenAI does: the client's intent under ``strict`` is unambiguous.
An explicit ``additionalProperties: true`` or schema is refused: strict mode cannot take it.
Without ``strict`` (or ``strict: false``) the schema is enforced as written, open objects
included.
"""

from __future__ import annotations

from typing import Any

from loraplex.engine.structured_output.closed_schema import close_objects, is_object_schema
from loraplex.gateway.errors import bad_request

UNSUPPORTED = (
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "patternProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "contains",
    "minContains",
    "maxContains",
)
"""Keywords strict mode refuses (OpenAI's list of unsupported keywords and composition)."""
_MAPS = ("properties", "$defs", "definitions")
_LISTS = ("anyOf", "oneOf", "prefixItems")


def strict_schema(schema: dict[str, Any], where: str) -> dict[str, Any]:
    """``schema`` closed as OpenAI's strict mode requires, or a 400 if strict mode cannot take it.

    Run it after the spec's bounds check (``engine.structured_output.bounds``): the walk is
    recursive, as deep as the schema's nesting.

    Args:
        schema: The ``json_schema.schema`` object.
        where: The field's dotted name, for the 400's ``param``
            (``response_format.json_schema.schema``).

    Returns:
        The schema with every object closed (``additionalProperties: false``); the input is
        not changed.

    Raises:
        APIError: 400 naming ``where``, saying which keyword at which JSON pointer.
    """
    if schema.get("type") != "object" or "anyOf" in schema:
        _refuse(where, "", "the root must be an object schema ('type': 'object'), not an anyOf")
    _check(schema, where, "")
    return close_objects(schema)


def _check(node: Any, where: str, at: str) -> None:
    if not isinstance(node, dict):
        return  # booleans and the like: the grammar library decides
    for key in UNSUPPORTED:
        if key in node:
            _refuse(where, at, f"'{key}' is not supported in strict mode")
    if is_object_schema(node):
        extra = node.get("additionalProperties", False)
        if extra is not False:
            _refuse(where, at, "'additionalProperties' must be false in strict mode")
        required = node.get("required", [])
        missing = [k for k in node.get("properties", {}) if k not in required]
        if missing:
            _refuse(
                where,
                at,
                f"every property must be in 'required' in strict mode (make it nullable "
                f"instead); missing {str(missing[0])[:64]!r}",
            )
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _check(sub, where, f"{at}/{key}/{_escape(str(name))}")
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _check(sub, where, f"{at}/{key}/{i}")
    if isinstance(node.get("items"), dict):
        _check(node["items"], where, f"{at}/items")


def _escape(name: str) -> str:
    """A JSON pointer token (RFC 6901), cut to 64 characters."""
    return name.replace("~", "~0").replace("/", "~1")[:64]


def _refuse(where: str, at: str, why: str) -> None:
    raise bad_request(f"'{where}' at '{at or '/'}': {why}", param=where)
