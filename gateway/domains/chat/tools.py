"""``tools``, ``tool_choice`` and ``parallel_tool_calls``: what a request offers and demands.

- The tools are rendered by the model's own chat template (``apply_chat_template(...,
  tools=...)``), except with ``tool_choice: "none"``, where the model is not told of tools it
  may not call.
- ``"required"`` and a named function are decoded under a grammar (vLLM's approach, through
  ``engine.structured_output.grammar``): the arguments always validate against the function's
  ``parameters`` schema, whatever the model and its template. The schema is closed first as
  OpenAI's strict mode has it (``engine.structured_output.closed_schema``: an object that does
  not say ``additionalProperties`` takes no other keys), with or without ``strict: true``, so a
  call ends after its last property.
- ``"auto"`` (the default with tools) leaves the choice to the model, whose output is parsed in
  its family's format (``gateway.domains.chat.tool_calls``); a model whose template teaches no
  format this server can parse gets a 400 for it.

Refused with a 400 naming the field: duplicate or malformed names (OpenAI's rule: 1 to 64
letters, digits, ``_`` or ``-``), more than 128 tools, ``parameters`` whose ``type`` is not
``"object"`` (OpenAI's: arguments are a JSON object), a named function not among the tools,
``tool_choice`` without ``tools``, and a tool choice together with a ``response_format`` or
``guided_*`` constraint (one output cannot follow two grammars), and ``strict: true`` with
``"auto"`` (only a forced call is decoded under its schema; this server does not pretend
otherwise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from loraplex.engine.structured_output.bounds import check_schema_bounds
from loraplex.engine.structured_output.closed_schema import close_objects, rebase_refs
from loraplex.engine.structured_output.grammar import StructuredOutputSpec
from loraplex.engine.structured_output.tool_call_format import FORMATS
from loraplex.gateway.domains.chat.body import ChatCompletionBody, NamedToolChoice
from loraplex.gateway.domains.chat.tool_calls import ToolCallStreamer
from loraplex.gateway.errors import bad_request

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers and how it wants them used.

    Attributes:
        tools: OpenAI's ``tools`` as plain objects, for the chat template (empty: render none).
        parameters: Each function's ``parameters`` schema by name.
        mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
        name: The function ``tool_choice`` names (``mode == "named"``).
        parallel: ``parallel_tool_calls`` (default true).
    """

    tools: list[dict[str, Any]]
    parameters: dict[str, dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True

    def structured_output(self) -> StructuredOutputSpec | None:
        """The grammar that forces the call (``required`` / ``named``); None otherwise.

        Each function's ``parameters`` is closed first (``engine.structured_output.
        closed_schema``: objects that do not say ``additionalProperties`` take no other keys,
        as OpenAI's strict mode has it) and its root made an object, so a call ends after its
        last property. ``required`` is a JSON array of ``{"name", "parameters"}`` objects
        (vLLM's form; at most one with ``parallel_tool_calls: false``), each function's schema
        under ``$defs`` with its local ``$ref`` pointers rebased there.

        Raises:
            ValueError: a schema past ``engine.structured_output.bounds`` (checked before it
                is walked) or too large for the engine (``MAX_SPEC_CHARS``).
        """
        if self.mode == "named":
            return StructuredOutputSpec.json_schema(arguments_schema(self.parameters[self.name]))
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        calls = []
        for i, (name, schema) in enumerate(self.parameters.items()):
            key = f"call{i}"
            defs[key] = rebase_refs(arguments_schema(schema), f"/$defs/{key}")
            calls.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": name},
                        "parameters": {"$ref": f"#/$defs/{key}"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        array["$defs"] = defs
        return StructuredOutputSpec.json_schema(array)

    def streamer(self, tool_call_format: str | None) -> ToolCallStreamer | None:
        """A fresh per-choice parser of the output; None when no call can come."""
        if self.mode == "none":
            return None
        return ToolCallStreamer(
            mode=self.mode,
            functions=frozenset(self.parameters),
            name=self.name,
            fmt=FORMATS.get(tool_call_format or ""),
            parallel=self.parallel,
        )


def arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema a forced call's arguments are decoded under: ``parameters``, closed, an object.

    Args:
        parameters: A function's ``parameters`` (already checked by :func:`parse_tools`).

    Returns:
        :func:`~loraplex.engine.structured_output.closed_schema.close_objects` of it, with
        ``"type": "object"`` at its root (OpenAI's arguments are always a JSON object).

    Raises:
        BoundError: the schema's shape is past ``engine.structured_output.bounds``.
    """
    check_schema_bounds(parameters)  # before walking it: bounds its depth
    closed = close_objects({**parameters, "type": "object"})
    return closed


def parse_tools(req: ChatCompletionBody, structured: bool) -> ToolRequest | None:
    """The request's tool use, checked; None when it offers no tools.

    Args:
        req: The typed body.
        structured: The body also asks for structured output (``response_format`` ...).

    Raises:
        APIError: 400 naming the field at fault (see the module doc).
    """
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice != "none":
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        if req.tools is not None:
            raise bad_request("'tools' must hold at least one tool", param="tools")
        return None
    if len(req.tools) > MAX_TOOLS:
        raise bad_request(f"'tools' holds more than {MAX_TOOLS} tools", param="tools")
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools):
        name = tool.function.name
        where = f"tools[{i}].function"
        if not _NAME.fullmatch(name):
            raise bad_request(
                f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'",
                param=f"{where}.name",
            )
        if name in parameters:
            raise bad_request(f"'{where}.name' repeats {name!r}", param=f"{where}.name")
        schema = tool.function.parameters
        kind = None if schema is None else schema.get("type", "object")
        if (
            kind is not None
            and kind != "object"
            and not (isinstance(kind, list) and "object" in kind)
        ):
            raise bad_request(
                f"'{where}.parameters' must describe a JSON object (the call's arguments), "
                f"not type {kind!r}",
                param=f"{where}.parameters",
            )
        parameters[name] = _NO_ARGUMENTS if schema is None else schema
    choice = req.tool_choice or "auto"
    name = None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in parameters:
            raise bad_request(
                f"'tool_choice' names {name!r}, which is not among the tools",
                param="tool_choice.function.name",
            )
        choice = "named"
    if choice == "auto":
        for i, tool in enumerate(req.tools):
            if tool.function.strict:
                raise bad_request(
                    "'strict' arguments are enforced only with 'tool_choice': 'required' or a "
                    "named function; 'auto' parses what the model writes",
                    param=f"tools[{i}].function.strict",
                )
    if structured and choice != "none":
        raise bad_request(
            "'tool_choice' other than 'none' cannot be combined with 'response_format' or "
            "guided_* fields",
            param="tool_choice",
        )
    return ToolRequest(
        tools=[] if choice == "none" else msgspec.to_builtins(req.tools),
        parameters=parameters,
        mode=choice,
        name=name,
        parallel=req.parallel_tool_calls is not False,
    )


def check_tool_messages(messages: list[Any]) -> int:
    """Check assistant ``tool_calls``; their text's UTF-8 bytes.

    Each call is ``{"id": str, "type": "function", "function": {"name": str, "arguments":
    str}}`` (``id`` and ``type`` may be left out), with ``arguments`` a string holding a JSON
    object, as OpenAI's answers carry it (vLLM parses it for the chat template too).

    Raises:
        APIError: 400 naming the part at fault: ``messages[i].tool_calls`` (not a list, or on
            another role), ``messages[i].tool_calls[j]`` (not an object), ``...id``,
            ``...type``, ``...function``, ``...function.name`` or ``...function.arguments``.
    """
    size = 0
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            continue
        where = f"messages[{i}].tool_calls"
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(f"'{where}' must be a list on an assistant message", param=where)
        for j, call in enumerate(calls):
            size += _check_call(call, f"{where}[{j}]")
    return size


def _check_call(call: Any, at: str) -> int:
    """Check one ``tool_calls`` element at path ``at``; its name's and arguments' bytes.

    Raises:
        APIError: 400 naming the field at fault (see :func:`check_tool_messages`).
    """
    if not isinstance(call, dict):
        raise bad_request(
            f"'{at}' must be {{id, type: 'function', function: {{name, arguments}}}}", param=at
        )
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise bad_request(f"'{at}.id' must be a string", param=f"{at}.id")
    if call.get("type", "function") != "function":
        raise bad_request(f"'{at}.type' must be 'function'", param=f"{at}.type")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise bad_request(
            f"'{at}.function' must be an object {{name, arguments}}", param=f"{at}.function"
        )
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str):
        raise bad_request(f"'{at}.function.name' must be a string", param=f"{at}.function.name")
    where = f"{at}.function.arguments"
    if not isinstance(arguments, str):
        raise bad_request(f"'{where}' must be a string holding a JSON object", param=where)
    try:
        parsed = msgspec.json.decode(arguments)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_request(
            f"'{where}' must be a string holding a JSON object (the call's arguments), "
            f"got {arguments[:40]!r}",
            param=where,
        )
    return len(name.encode("utf-8", "surrogatepass")) + len(
        arguments.encode("utf-8", "surrogatepass")
    )
