"""Closed JSON schemas for forced tool calls: OpenAI's strict mode, as a grammar can enforce it.

JSON Schema lets an object carry any key its schema does not forbid: ``{"type": "object",
"properties": {"city": ...}}`` also matches ``{"city": "Oslo", "x": 1, "y": 2, ...}``. Decoded
under such a schema, a model may keep adding keys until ``max_tokens`` (issue 31: LangChain's
``bind_tools(..., tool_choice="any")`` sends schemas without ``additionalProperties``). OpenAI's
Structured Outputs strict mode requires ``"additionalProperties": false`` on every object
(docs/structured_output.md, "Forced tool calls"); :func:`close_objects` gives an object schema
that does not say ``additionalProperties`` that meaning, so the grammar closes the object after
its properties.

What is closed, and what is left as the schema says:

- Closed: every object schema (``"type": "object"`` or one with ``properties``,
  ``patternProperties`` or ``required``) without ``additionalProperties`` or
  ``unevaluatedProperties``, wherever it sits under ``properties``, ``patternProperties``,
  ``additionalProperties``, ``items``, ``prefixItems``, ``additionalItems``, ``contains``,
  ``anyOf``, ``oneOf``, ``$defs``, ``definitions``, or the single member of an ``allOf``.
- Left open: objects that are conjuncts (the members of an ``allOf`` of two or more; an object
  schema that also has a ``$ref``, ``allOf``, ``anyOf`` or ``oneOf``, and those members; ``if``
  / ``then`` / ``else``; ``dependentSchemas``) and everything under ``not``: closing one
  conjunct would forbid the keys its siblings define, and closing under ``not`` would widen
  what the schema allows. A local ``$defs`` / ``definitions`` entry that such a place refers to
  stays open too.
- An explicit ``additionalProperties`` (``true`` or a schema) is kept: those objects still take
  extra keys, as the schema asks.
- ``required`` is kept as the schema says (OpenAI's strict mode also requires every property
  to be listed in ``required``; here optional properties stay optional).

Closing only narrows: every output of the closed schema validates against the original one.
:func:`rebase_refs` moves a schema under another document (the ``required`` form's array of
calls) with its local ``$ref`` pointers rewritten to follow it.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema map, split by
# whether an object there is closed (a full alternative or a value's own schema) or left open (a
# conjunct, or under ``not``).
_ONE_CLOSED = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames")
_LIST_CLOSED = ("anyOf", "oneOf", "prefixItems", "items")
_APPLICATORS = ("$ref", "allOf", "anyOf", "oneOf")
_MAP_CLOSED = ("properties", "patternProperties", "$defs", "definitions")
_ONE_OPEN = ("not", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties")
_LIST_OPEN = ("allOf",)
_MAP_OPEN = ("dependentSchemas",)
_OBJECT_KEYWORDS = ("properties", "patternProperties", "required")
_DEFS = ("$defs", "definitions")


def is_object_schema(node: Any) -> bool:
    """Whether ``node`` describes objects by its own keywords (``type`` or object keywords)."""
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return any(k in node for k in _OBJECT_KEYWORDS)


def _conjunct_owner(node: dict[str, Any]) -> bool:
    """An object schema whose keys a ``$ref``, ``allOf``, ``anyOf`` or ``oneOf`` also define."""
    return is_object_schema(node) and any(k in node for k in _APPLICATORS)


def _members_open(node: dict[str, Any], key: str) -> bool:
    """Whether the members of list keyword ``key`` of ``node`` are conjuncts (left open)."""
    if key == "allOf":
        return len(node[key]) != 1 or _conjunct_owner(node)
    return key in ("anyOf", "oneOf") and _conjunct_owner(node)


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its object schemas closed (see the module doc); the input is not changed.

    The walk follows only the keywords above, so its recursion is as deep as the schema's
    nesting, which ``engine.structured_output.bounds.check_schema_bounds`` bounds (run it
    first on untrusted schemas). Nodes it does not change are shared, not copied.

    Args:
        schema: A JSON schema (a tool's ``parameters``).

    Returns:
        The closed schema.
    """
    open_defs = _defs_left_open(schema)
    return _close(schema, closing=True, open_defs=open_defs, at_root=True)


def _close(node: Any, closing: bool, open_defs: set[str], at_root: bool = False) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if (
        closing
        and not _conjunct_owner(node)
        and is_object_schema(node)
        and "additionalProperties" not in node
        and "unevaluatedProperties" not in node
    ):
        out["additionalProperties"] = False
    for key in _ONE_CLOSED + _ONE_OPEN:
        if isinstance(node.get(key), dict):
            keep = closing and key in _ONE_CLOSED
            out[key] = _close(node[key], keep, open_defs)
    for key in _LIST_CLOSED + _LIST_OPEN:
        if isinstance(node.get(key), list):
            keep = closing and not _members_open(node, key)
            out[key] = [_close(s, keep, open_defs) for s in node[key]]
    for key in _MAP_CLOSED + _MAP_OPEN:
        if isinstance(node.get(key), dict):
            defs = at_root and key in _DEFS
            out[key] = {
                name: _close(
                    s,
                    closing and key in _MAP_CLOSED and not (defs and name in open_defs),
                    open_defs,
                )
                for name, s in node[key].items()
            }
    return out


def _defs_left_open(root: dict[str, Any]) -> set[str]:
    """Names of the root's ``$defs`` / ``definitions`` referred to from a place left open.

    A ``$ref`` of the form ``#/$defs/NAME`` or ``#/definitions/NAME`` (the only ones followed)
    inside a conjunct or under ``not``, or next to an object's own keywords, keeps ``NAME``
    open, and so do the refs inside ``NAME`` in turn.
    """
    defs: dict[str, Any] = {}
    for key in _DEFS:
        if isinstance(root.get(key), dict):
            defs.update(root[key])
    found: set[str] = set()
    todo: list[tuple[Any, bool]] = [(root, False)]
    while todo:
        node, open_here = todo.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and (open_here or _conjunct_owner(node)):
            name = _local_def(ref)
            if name is not None and name in defs and name not in found:
                found.add(name)
                todo.append((defs[name], True))
        for key in _ONE_CLOSED + _ONE_OPEN:
            if isinstance(node.get(key), dict):
                todo.append((node[key], open_here or key in _ONE_OPEN))
        for key in _LIST_CLOSED + _LIST_OPEN:
            if isinstance(node.get(key), list):
                opened = open_here or _members_open(node, key)
                todo.extend((s, opened) for s in node[key])
        for key in _MAP_CLOSED + _MAP_OPEN:
            if isinstance(node.get(key), dict) and not (node is root and key in _DEFS):
                todo.extend((s, open_here or key in _MAP_OPEN) for s in node[key].values())
    return found


def _local_def(ref: str) -> str | None:
    """``NAME`` of ``#/$defs/NAME`` or ``#/definitions/NAME`` (JSON-pointer escapes undone)."""
    for key in _DEFS:
        prefix = f"#/{key}/"
        if ref.startswith(prefix) and "/" not in ref[len(prefix) :]:
            return ref[len(prefix) :].replace("~1", "/").replace("~0", "~")
    return None


def rebase_refs(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """``schema`` as it must read once placed at JSON pointer ``pointer`` of another document.

    Every local ``$ref`` (``#`` or ``#/...``) in a schema position is prefixed with
    ``pointer``; other refs (URIs) are kept. The root's ``$schema`` and ``$id`` are dropped (an
    ``$id`` would make the rewritten refs resolve against the subschema again).

    Args:
        schema: A JSON schema whose refs point into itself.
        pointer: Where it goes, e.g. ``"/$defs/call0"``.

    Returns:
        The rebased schema (the input is not changed).
    """
    out = _rebase(schema, pointer)
    if isinstance(out, dict):
        out.pop("$schema", None)
        out.pop("$id", None)
    return out


def _rebase(node: Any, pointer: str) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + pointer + ref[1:]
    for key in _ONE_CLOSED + _ONE_OPEN:
        if isinstance(node.get(key), dict):
            out[key] = _rebase(node[key], pointer)
    for key in _LIST_CLOSED + _LIST_OPEN:
        if isinstance(node.get(key), list):
            out[key] = [_rebase(s, pointer) for s in node[key]]
    for key in _MAP_CLOSED + _MAP_OPEN:
        if isinstance(node.get(key), dict):
            out[key] = {name: _rebase(s, pointer) for name, s in node[key].items()}
    return out
