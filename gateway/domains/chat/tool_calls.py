"""Tool calls out of generated text, streamed or not: one :class:`ToolCallStreamer` per choice.

Three modes, from the request's ``tool_choice`` (:class:`gateway.domains.chat.tools.ToolRequest`):

- **named** (``{"type": "function", "function": {"name": ...}}``): the output was decoded under
  the function's parameters schema, so the whole text *is* the arguments: a header delta (id,
  name) goes first, then the text streams as ``function.arguments`` deltas.
- **required**: the output was decoded under a schema of a JSON array of
  ``{"name", "parameters"}`` objects (vLLM's form, independent of the model's template); it is
  buffered and parsed at the end, one call per element.
- **auto**: the model chose. Its text is parsed in the model family's own tool-call format,
  found from the chat template (``engine.structured_output.tool_call_format.FORMATS``; Hermes / Qwen
  ``<tool_call>{json}</tool_call>`` is built in). Text outside calls streams as ``content``;
  text that could be the start of a call marker is held back until it is known not to be one;
  a call's text is buffered until its end marker, then sent as one tool-call delta.
  Whitespace next to a call is not content (it is held back until text other than a call
  follows it). A call that does not parse, or names a function the request did not offer, is
  left in ``content``: nothing the client did not ask for becomes a call.

A choice that made at least one call and stopped normally finishes with ``"tool_calls"``
(OpenAI's). A named or required call the grammar did not complete (cut by ``max_tokens``, or by
a ``stop`` string) is never a call and never ``content``: the choice keeps the engine's finish
reason (``"length"``), and its message has ``content`` null and no ``tool_calls``. A stream
cannot take back what it sent: a named call's ``arguments`` deltas already out stay out (as
OpenAI's and vLLM's streams do), and the finish reason says they are incomplete; the required
form is buffered, so nothing of a cut one is sent.

Deltas are OpenAI's ``chat.completion.chunk`` deltas; :func:`fold` adds them up into the
non-streamed ``message`` (``content`` None when empty, ``tool_calls`` when any), and
:meth:`ToolCallStreamer.message` gives the non-streamed message, cut calls left out.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.structured_output.tool_call_format import ToolCallFormat


def new_call_id() -> str:
    """A tool call's id (``call_`` and 24 hex digits, as OpenAI's look)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_delta(index: int, name: str, arguments: str, call_id: str | None = None) -> dict:
    return {
        "index": index,
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass
class ToolCallStreamer:
    """Turns one choice's text deltas into ``content`` / ``tool_calls`` deltas.

    Args:
        mode: ``"named"``, ``"required"`` or ``"auto"``.
        functions: The offered functions' names (calls to others stay text).
        name: The named function (``mode == "named"``).
        fmt: The model's format (``mode == "auto"``).
        parallel: More than one call may be made (``parallel_tool_calls``); in ``auto`` mode a
            second call's text is then left in ``content``.
    """

    mode: str
    functions: frozenset[str]
    name: str | None = None
    fmt: ToolCallFormat | None = None
    parallel: bool = True
    calls: int = 0
    cut: bool = False  # a forced call the grammar did not complete (set by finish)
    _buffer: str = ""
    _in_call: bool = False
    _named_id: str = field(default_factory=new_call_id)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` (the choice's next piece of output) makes ready now."""
        if not text:
            return []
        if self.mode == "named":
            deltas = []
            if self.calls == 0:
                self.calls = 1
                deltas.append({"tool_calls": [_call_delta(0, self.name, "", self._named_id)]})
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            self._buffer += text  # kept to check, at the end, that the call is complete
            return deltas
        self._buffer += text
        if self.mode == "required":
            return []
        return self._scan(final=False)

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas, and the choice's finish reason (``"tool_calls"`` after a call)."""
        deltas: list[dict[str, Any]] = []
        if self.mode == "required":
            deltas = self._required(finish_reason)
        elif self.mode == "auto":
            deltas = self._scan(final=True)
        elif self.mode == "named":
            self.cut = not isinstance(_json_or_none(self._buffer), dict)
            self._buffer = ""
        if self.calls and not self.cut and finish_reason == "stop":
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed ``message`` of a whole choice's ``text``, and its finish reason.

        As a stream of the text folds (:func:`fold`), except that a forced call the grammar
        did not complete is left out (``content`` null, no ``tool_calls``): nothing that is
        not a whole call is offered as one.
        """
        deltas = self.feed(text)
        last, finish_reason = self.finish(finish_reason)
        message = fold(deltas + last)
        if self.cut:
            message = {"role": "assistant", "content": None}
        return message, finish_reason

    def _required(self, finish_reason: str | None) -> list[dict[str, Any]]:
        text, self._buffer = self._buffer, ""
        calls = _json_or_none(text)
        ok = (
            isinstance(calls, list)
            and calls
            and all(
                isinstance(c, dict)
                and c.get("name") in self.functions
                and isinstance(c.get("parameters", {}), dict)
                for c in calls
            )
        )
        if not ok:  # cut before the grammar completed: no call, and not content either
            self.cut = True
            return []
        out = []
        for c in calls:
            arguments = json.dumps(c.get("parameters", {}), ensure_ascii=False)
            out.append(_call_delta(self.calls, c["name"], arguments))
            self.calls += 1
        return [{"tool_calls": out}]

    def _scan(self, final: bool) -> list[dict[str, Any]]:
        """Auto mode: emit the text known to be content, and every complete call."""
        fmt = self.fmt
        deltas: list[dict[str, Any]] = []
        while self._buffer:
            if self._in_call:
                end = self._buffer.find(fmt.end)
                if end < 0:
                    if final:  # cut off inside a call: what came is plain text after all
                        deltas.append({"content": fmt.start + self._buffer})
                        self._buffer = ""
                    break
                inner, self._buffer = self._buffer[:end], self._buffer[end + len(fmt.end) :]
                self._in_call = False
                parsed = fmt.parse(inner.strip())
                if (
                    parsed is None
                    or parsed[0] not in self.functions
                    or (self.calls and not self.parallel)
                ):
                    deltas.append({"content": fmt.start + inner + fmt.end})
                    continue
                deltas.append({"tool_calls": [_call_delta(self.calls, *parsed)]})
                self.calls += 1
                continue
            start = self._buffer.find(fmt.start)
            if start >= 0:
                before, self._buffer = self._buffer[:start], self._buffer[start + len(fmt.start) :]
                self._in_call = True
                if before.strip():  # whitespace next to a call is not content
                    deltas.append({"content": before.rstrip()})
                continue
            if final:  # trailing whitespace is content only in a message without calls
                rest, self._buffer = self._buffer, ""
                if rest.strip() or not self.calls:
                    deltas.append({"content": rest if not self.calls else rest.rstrip()})
                break
            keep = _partial_marker(self._buffer, fmt.start)
            ready = self._buffer[: len(self._buffer) - keep]
            ready = ready[: len(ready.rstrip())]  # whitespace waits: a call may follow it
            self._buffer = self._buffer[len(ready) :]
            if ready:
                deltas.append({"content": ready})
            break
        return _merge(deltas)


def _json_or_none(text: str) -> Any:
    """``text`` parsed as JSON; None when it is not (an incomplete call, say)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent content deltas as one."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and set(d) == {"content"} and set(out[-1]) == {"content"}:
            out[-1] = {"content": out[-1]["content"] + d["content"]}
        else:
            out.append(d)
    return out


def fold(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streamed ``message`` the deltas add up to (OpenAI's accumulation rule)."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", ()):
            if c["index"] not in calls:
                calls[c["index"]] = {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": ""},
                }
            calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
        if not content.strip():
            message["content"] = None
    return message
