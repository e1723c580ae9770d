"""Responses API ``input`` items as chat messages (OpenAI's ``ResponseInputItemParam``).

Each accepted item becomes (part of) one Chat Completions message, which the chat pipeline
then checks and renders with the model's chat template (``gateway.domains.chat.schemas``)::

    "text"                                       -> {"role": "user", "content": "text"}
    {"type": "message", "role": r, "content": c} -> {"role": r, "content": c'}
        c' : a string as it is; parts input_text / output_text -> {"type": "text"},
             input_image {image_url, detail} -> {"type": "image_url", "image_url": {...}}
    {"type": "function_call", call_id, name, arguments}
        -> an assistant message's tool_calls[] entry (consecutive calls, and the assistant
           text right before them, form one assistant message, as a chat turn holds them)
    {"type": "function_call_output", call_id, output}
        -> {"role": "tool", "tool_call_id": call_id, "content": output}

``type`` may be left out of a message item (OpenAI's ``EasyInputMessage``). Refused with a
400 naming the item (``input[i]``, ``input[i].content[j]``, ...): any other item type
(``item_reference``, ``reasoning``, built-in tool calls and their outputs), ``input_file``
and ``input_audio`` parts, an image by ``file_id``, an ``image_url.detail`` other than
``auto`` (the chat path's rule), a missing or mistyped field, and unknown fields of an item.
Images are ``data:`` URLs only, as on the chat path (nothing is ever fetched; the chat
checks refuse other schemes).
"""

from __future__ import annotations

from typing import Any

import msgspec

from loraplex.gateway.errors import bad_request

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}


def input_messages(items: str | list[Any], where: str = "input") -> tuple[list[dict], list[str]]:
    """The chat messages ``input`` stands for, and each message's origin (``input[i]``).

    Args:
        items: The ``input`` field: a string or a list of items.
        where: The field's name in error messages.

    Returns:
        ``(messages, origins)``: chat messages, and per message the path of the item it came
        from (the first, for an assistant message gathered from several items).

    Raises:
        APIError: 400 naming the item or field at fault.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [where]
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{at}' must be an input item (an object)", param=at)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, at))
            origins.append(at)
        elif kind == "function_call":
            call = _function_call(item, at)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and _can_take_calls(last):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(at)
        elif kind == "function_call_output":
            messages.append(_call_output(item, at))
            origins.append(at)
        else:
            shown = kind[:40] if isinstance(kind, str) else type(kind).__name__
            raise bad_request(
                f"'{at}.type' {shown!r} is not supported: this server takes 'message', "
                "'function_call' and 'function_call_output' items",
                param=f"{at}.type",
            )
    return messages, origins


def _can_take_calls(message: dict[str, Any]) -> bool:
    """A gathered assistant message may take more calls: its content is text (or none)."""
    return message.get("content") is None or isinstance(message.get("content"), str)


def _message(item: dict[str, Any], at: str) -> dict[str, Any]:
    _no_unknown(item, _MESSAGE_KEYS, at)
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(
            f"'{at}.role' must be one of {', '.join(repr(r) for r in MESSAGE_ROLES)}",
            param=f"{at}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(
            f"'{at}.content' must be a string or a list of content parts", param=f"{at}.content"
        )
    return {
        "role": role,
        "content": [_part(p, f"{at}.content[{j}]") for j, p in enumerate(content)],
    }


def _part(part: Any, at: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        _no_unknown(part, {"type", "text", "annotations", "logprobs"}, at)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{at}.text' must be a string", param=f"{at}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        _no_unknown(part, {"type", "image_url", "file_id", "detail"}, at)
        if part.get("file_id") is not None:
            raise bad_request(
                f"'{at}.file_id': files are not served here; send the image as a data: URL in "
                "'image_url'",
                param=f"{at}.file_id",
            )
        url = part.get("image_url")
        if not isinstance(url, str):
            raise bad_request(
                f"'{at}.image_url' must be a string (a data: URL)", param=f"{at}.image_url"
            )
        detail = part.get("detail")
        if detail not in (None, "auto"):
            raise bad_request(
                f"'{at}.detail' must be 'auto': this model sees every image at its vision "
                "encoder's one resolution",
                param=f"{at}.detail",
            )
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "refusal":
        _no_unknown(part, {"type", "refusal"}, at)
        if not isinstance(part.get("refusal"), str):
            raise bad_request(f"'{at}.refusal' must be a string", param=f"{at}.refusal")
        return {"type": "text", "text": part["refusal"]}
    shown = kind[:40] if isinstance(kind, str) else None
    raise bad_request(
        f"'{at}.type' {shown!r} is not supported: content parts are 'input_text', "
        "'input_image' (a data: URL) and, in assistant messages, 'output_text'",
        param=f"{at}.type",
    )


def _function_call(item: dict[str, Any], at: str) -> dict[str, Any]:
    _no_unknown(item, _CALL_KEYS, at)
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"'{at}.{key}' must be a string", param=f"{at}.{key}")
    if item.get("namespace") is not None:
        raise bad_request(f"'{at}.namespace' is not supported", param=f"{at}.namespace")
    try:
        arguments = msgspec.json.decode(item["arguments"])
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(
            f"'{at}.arguments' must be a string holding a JSON object", param=f"{at}.arguments"
        )
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _call_output(item: dict[str, Any], at: str) -> dict[str, Any]:
    _no_unknown(item, _OUTPUT_KEYS, at)
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"'{at}.call_id' must be a string", param=f"{at}.call_id")
    output = item.get("output")
    if isinstance(output, list):  # only text parts: a tool message carries text
        texts = []
        for j, part in enumerate(output):
            where = f"{at}.output[{j}]"
            if not isinstance(part, dict) or part.get("type") != "input_text":
                raise bad_request(
                    f"'{where}' must be an 'input_text' part: a function's output is text here",
                    param=where,
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}.text' must be a string", param=f"{where}.text")
            texts.append(part["text"])
        output = "".join(texts)
    if not isinstance(output, str):
        raise bad_request(f"'{at}.output' must be a string", param=f"{at}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _no_unknown(item: dict[str, Any], known: set[str], at: str) -> None:
    for key in item:
        if key not in known:
            raise bad_request(
                f"unknown field '{at}.{str(key)[:40]}': this server does not support it",
                param=f"{at}.{str(key)[:40]}",
            )
