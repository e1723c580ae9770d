"""Structured-output fields of a request body: OpenAI's ``response_format`` and vLLM's guided_*.

OpenAI's shapes (Chat Completions):

- ``{"type": "text"}``: free text (the default);
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...,
  "description": ...}}``: JSON valid against the schema. The schema is always enforced: a
  keyword the grammar library cannot enforce is refused with a 400 at admission, never
  ignored. With ``strict: true`` it is also taken as OpenAI's strict mode does
  (``gateway.domains.chat.strict_schema``): every object closed (``additionalProperties:
  false``), and a schema strict mode cannot take (an open object, an optional property,
  ``allOf``, ``not`` ...) a 400.

vLLM's extra fields, for clients written against it: ``guided_json`` (a schema, object or JSON
text), ``guided_regex`` (the whole output matches it), ``guided_choice`` (the output is one of
the strings). At most one of these, ``response_format`` included, may ask for a constraint.

Everything else (another ``type``, a missing ``schema``, a ``name`` that is not a string) is a
400 naming the field, and so is a spec past the structural bounds
(``engine.structured_output.bounds``: depth, properties, enums, regex repetition), checked here
before the request goes further. Whether the schema itself can be enforced is decided by the
grammar sandbox and the engine's compiler (``engine.structured_output.grammar``), whose refusal is
also a 400 naming this field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.engine.structured_output.grammar import MAX_SPEC_CHARS, StructuredOutputSpec
from loraplex.gateway.domains.chat.strict_schema import strict_schema
from loraplex.gateway.errors import bad_request

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")
MAX_CHOICES = 256
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def parse_structured_output(data: dict[str, Any]) -> tuple[StructuredOutputSpec | None, str]:
    """The constraint a request body asks for, and the field that asked.

    Args:
        data: The decoded request body.

    Returns:
        ``(spec, field)``; ``(None, "")`` for free text.

    Raises:
        APIError: 400 naming the field at fault.
    """
    asked = [name for name in FIELDS if data.get(name) is not None]
    if data.get("response_format") is not None and _type(data["response_format"]) == "text":
        asked.remove("response_format")
    if len(asked) > 1:
        raise bad_request(f"only one of {', '.join(asked)} may be given", param=asked[1])
    if not asked:
        return None, ""
    name = asked[0]
    value = data[name]
    try:
        if name == "response_format":
            spec = _response_format(value)
        elif name == "guided_json":
            spec = _schema(value, name)
        elif name == "guided_regex":
            if not isinstance(value, str) or not value:
                raise bad_request("'guided_regex' must be a non-empty string", param=name)
            spec = StructuredOutputSpec("regex", value)
        else:
            spec = _choice(value)
        spec = spec.check_bounds()  # its shape (engine.structured_output.bounds), linear
        if name == "response_format" and _strict(value):  # after the bounds: a bounded walk
            where = "response_format.json_schema.schema"
            spec = StructuredOutputSpec.json_schema(strict_schema(json.loads(spec.value), where))
        return spec, name
    except ValueError as exc:  # the spec's own checks (length, shape)
        raise bad_request(str(exc), param=name) from None


def _strict(value: dict[str, Any]) -> bool:
    """Whether a (checked) ``response_format`` asks for OpenAI's strict mode."""
    return value.get("type") == "json_schema" and value["json_schema"].get("strict") is True


def _type(value: Any) -> str | None:
    if not isinstance(value, dict):
        raise bad_request("'response_format' must be an object", param="response_format")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type",
        )
    return kind


def _response_format(value: dict[str, Any]) -> StructuredOutputSpec:
    kind = _type(value)
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    inner = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(inner, dict):
        raise bad_request(f"'{where}' must be an object", param=where)
    name = inner.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'", param=f"{where}.name"
        )
    for key, kind_ in (("strict", bool), ("description", str)):
        if inner.get(key) is not None and not isinstance(inner[key], kind_):
            raise bad_request(f"'{where}.{key}' has the wrong type", param=f"{where}.{key}")
    if "schema" not in inner:
        raise bad_request(f"'{where}.schema' is required", param=f"{where}.schema")
    return _schema(inner["schema"], f"{where}.schema")


def _schema(schema: Any, where: str) -> StructuredOutputSpec:
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise bad_request(f"'{where}' is longer than {MAX_SPEC_CHARS} characters", param=where)
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError):
            raise bad_request(
                f"'{where}' is not valid JSON (or nests too deeply)", param=where
            ) from None
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}' must be a JSON schema object", param=where)
    return StructuredOutputSpec.json_schema(schema)


def _choice(value: Any) -> StructuredOutputSpec:
    if (
        not isinstance(value, list)
        or not value
        or len(value) > MAX_CHOICES
        or not all(isinstance(c, str) and c for c in value)
    ):
        raise bad_request(
            f"'guided_choice' must be 1 to {MAX_CHOICES} non-empty strings", param="guided_choice"
        )
    return StructuredOutputSpec("regex", "|".join(f"({_escape(c)})" for c in value))


def _escape(text: str) -> str:
    """``text`` as a literal in llguidance's (Rust ``regex``) syntax."""
    return "".join("\\" + c if c in _META else c for c in text)


_META = frozenset("\\.+*?()|[]{}^$#&-~")
