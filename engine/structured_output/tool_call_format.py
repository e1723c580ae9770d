"""Tool-call syntaxes of model families, and which one a chat template teaches.

A chat template that renders ``tools`` also shows the model how to call them; the gateway
parses ``tool_choice: "auto"`` outputs in that syntax (``gateway.domains.chat.tool_calls``).
Pluggable: a new family is one more :class:`ToolCallFormat` in :data:`FORMATS`, found by its
markers in the template (:func:`detect_tool_call_format`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol


class ToolCallFormat(Protocol):
    """A model family's tool-call syntax (pluggable: add one to :data:`FORMATS`)."""

    start: str  # the marker that opens a call
    end: str  # the marker that closes it

    def parse(self, inner: str) -> tuple[str, str] | None:
        """``(name, arguments JSON)`` of the text between the markers, None if malformed."""
        ...


@dataclass(frozen=True)
class HermesFormat:
    """Hermes / Qwen 2.5+: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def parse(self, inner: str) -> tuple[str, str] | None:
        """See :class:`ToolCallFormat`."""
        try:
            call = json.loads(inner)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)


FORMATS: dict[str, ToolCallFormat] = {"hermes": HermesFormat()}


def detect_tool_call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, by its markers; None if unknown."""
    if not chat_template:
        return None
    for name, fmt in FORMATS.items():
        if fmt.start in chat_template and fmt.end in chat_template:
            return name
    return None
