"""A Responses API request as a Chat Completions request: one generation path for both.

:func:`translate` checks what only the Responses API has (``input`` items, ``text.format``,
function tools in their flat form, the refused fields) and builds the Chat Completions body
the chat pipeline parses (``gateway.domains.chat.schemas.parse_chat_request``), so sampling
ranges, tools, structured output, images and lengths are checked exactly as for chat::

    instructions                 -> a leading {"role": "system"} message (not carried over
                                    from a previous response: OpenAI's rule)
    previous response's context  -> the messages before this turn's input
    input                        -> messages (``gateway.domains.responses.items``)
    max_output_tokens            -> max_completion_tokens
    temperature, top_p, parallel_tool_calls      -> the same
    tools [{type: function, name, description, parameters, strict}]
                                 -> [{type: function, function: {...}}]
    tool_choice {type: function, name}           -> {type: function, function: {name}}
    text.format {type: json_schema, name, schema, description, strict}
                                 -> response_format {type: json_schema, json_schema: {...}}
    text.format {type: json_object | text}       -> response_format the same

A 400 the chat checks raise names the chat field; :func:`responses_param` renames it to the
Responses field (``messages[3]`` -> the input item it came from, ``max_completion_tokens`` ->
``max_output_tokens``, ``response_format`` -> ``text.format``, ``tools[i].function.x`` ->
``tools[i].x``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from loraplex.gateway.domains.chat.body import convert_body
from loraplex.gateway.domains.chat.service_tier import service_tier_of
from loraplex.gateway.domains.responses.body import REFUSED, ResponsesBody
from loraplex.gateway.domains.responses.items import input_messages
from loraplex.gateway.errors import bad_request

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_FORMAT_KEYS = {"type", "name", "schema", "description", "strict"}


@dataclass(frozen=True)
class Translation:
    """A checked Responses request and the Chat Completions body it becomes.

    Attributes:
        body: The typed Responses body.
        chat: The Chat Completions body (a dict, for ``parse_chat_request``).
        origins: Per chat message, the Responses field it came from (error messages).
        store: Keep the response (``store``, default true as OpenAI's).
        service_tier: The tier that serves it (``default`` or ``flex``), echoed in the
            Response object (``gateway.domains.chat.service_tier``).
    """

    body: ResponsesBody
    chat: dict[str, Any]
    origins: list[str]
    store: bool
    service_tier: str = "default"


def check_body(data: dict[str, Any], max_items: int) -> ResponsesBody:
    """``data`` as a :class:`ResponsesBody`, the refused and Responses-only fields checked.

    Args:
        data: The decoded request body.
        max_items: Most ``input`` items (the model length: each costs at least one token).

    Raises:
        APIError: 400 naming the field at fault.
    """
    for name, why in REFUSED.items():
        value = data.get(name)
        if value is not None and not (name == "background" and value is False):
            raise bad_request(f"'{name}' is not supported: {why}", param=name)
    body: ResponsesBody = convert_body(data, ResponsesBody)
    if body.input is None:
        raise bad_request("'input' is required: a string or a list of input items", param="input")
    if isinstance(body.input, list):
        if not body.input:
            raise bad_request("'input' must hold at least one item", param="input")
        if len(body.input) > max_items:
            raise bad_request(
                f"'input' holds {len(body.input)} items; at most {max_items} fit this model",
                param="input",
                code="context_length_exceeded",
            )
    if body.truncation not in (None, "disabled"):
        raise bad_request(
            "'truncation' must be 'disabled': this server never drops input to fit the model",
            param="truncation",
        )
    if body.include:
        raise bad_request(
            f"'include' value {body.include[0][:64]!r} is not supported: this server adds no "
            "optional output data",
            param="include",
        )
    if body.reasoning is not None:
        for key, value in body.reasoning.items():
            if value is not None:
                raise bad_request(
                    f"'reasoning.{key[:32]}' is not supported: the served model is not a "
                    "reasoning model",
                    param=f"reasoning.{key[:32]}",
                )
    _check_metadata(body.metadata)
    return body


def translate(
    body: ResponsesBody,
    context: list[dict[str, Any]],
    max_items: int,
) -> Translation:
    """The Chat Completions body for a checked Responses body.

    Args:
        body: From :func:`check_body`.
        context: The previous response's conversation (chat messages), or [].
        max_items: Most messages in all.

    Raises:
        APIError: 400 naming the field at fault.
    """
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    messages.extend(context)
    origins.extend(["previous_response_id"] * len(context))
    new, new_origins = input_messages(body.input)
    messages.extend(new)
    origins.extend(new_origins)
    if len(messages) > max_items:
        raise bad_request(
            f"the conversation holds {len(messages)} messages; at most {max_items} fit this model",
            param="input",
            code="context_length_exceeded",
        )
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    for name, value in (
        ("max_completion_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("parallel_tool_calls", body.parallel_tool_calls),
        ("stream", body.stream),
        ("service_tier", body.service_tier),
    ):
        if value is not None:
            chat[name] = value
    if body.tools is not None:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    response_format = _text_format(body.text)
    if response_format is not None:
        chat["response_format"] = response_format
    return Translation(
        body=body,
        chat=chat,
        origins=origins,
        store=body.store is not False,
        service_tier=service_tier_of(body.service_tier),  # 400 naming service_tier
    )


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(
            f"'metadata' holds more than {MAX_METADATA_PAIRS} pairs", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"'metadata' keys are at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE}",
                param="metadata",
            )


def _tool(tool: Any, at: str) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        shown = kind[:40] if isinstance(kind, str) else None
        raise bad_request(
            f"'{at}.type' {shown!r} is not supported: this server runs no built-in tools "
            "(web search, file search, computer use, code interpreter, MCP ...); only 'function' "
            "tools, which the client runs",
            param=f"{at}.type",
        )
    for key in tool:
        if key not in _TOOL_KEYS:
            raise bad_request(
                f"unknown field '{at}.{str(key)[:40]}': this server does not support it",
                param=f"{at}.{str(key)[:40]}",
            )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                "'name': ...}",
                param="tool_choice",
            )
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise bad_request(
            "'tool_choice' objects must be {'type': 'function', 'name': ...}: built-in tools, "
            "'allowed_tools', MCP and custom tools are not supported",
            param="tool_choice.type",
        )
    if not isinstance(choice["name"], str):
        raise bad_request("'tool_choice.name' must be a string", param="tool_choice.name")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    for key in text:
        if key == "verbosity" and text[key] is None:
            continue
        if key != "format":
            why = "the served model is not a reasoning model" if key == "verbosity" else ""
            raise bad_request(
                f"'text.{str(key)[:40]}' is not supported{': ' + why if why else ''}",
                param=f"text.{str(key)[:40]}",
            )
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "'text.format.type' must be 'text', 'json_object' or 'json_schema'",
            param="text.format.type",
        )
    kind = fmt["type"]
    known = _FORMAT_KEYS if kind == "json_schema" else {"type"}
    for key in fmt:
        if key not in known:
            raise bad_request(
                f"unknown field 'text.format.{str(key)[:40]}' for type {kind!r}",
                param=f"text.format.{str(key)[:40]}",
            )
    if kind != "json_schema":
        return {"type": kind}
    inner = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


_MESSAGE = re.compile(r"^messages\[(\d+)\]")
_RENAMES = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tool_choice.function.name", "tool_choice.name"),
)
_TOOL_FUNCTION = re.compile(r"^(tools\[\d+\])\.function")


def responses_param(param: str | None, origins: list[str]) -> str | None:
    """The Responses field a chat check's ``param`` stands for (see the module doc)."""
    if not param:
        return param
    found = _MESSAGE.match(param)
    if found:
        index = int(found.group(1))
        origin = origins[index] if index < len(origins) else "input"
        rest = param[found.end() :].replace(".image_url.url", ".image_url")
        return origin + rest if origin.startswith("input[") else origin
    if param == "messages":
        return "input"
    for old, new in _RENAMES:
        if param == old or param.startswith(old + "."):
            return new + param[len(old) :]
    return _TOOL_FUNCTION.sub(r"\1", param)
