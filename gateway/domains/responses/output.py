"""The Response object, its output items and its stream events, from one chat run's output.

Shapes (OpenAI's Responses API reference; what the ``openai`` SDK's ``Response`` and
``ResponseStreamEvent`` types parse)::

    response      {id, object: "response", created_at, status, error, incomplete_details,
                   instructions, max_output_tokens, model, output: [item], parallel_tool_calls,
                   previous_response_id, store, temperature, top_p, text: {format},
                   tool_choice, tools, truncation, usage, user, metadata, ...}
    message item  {id: "msg_...", type: "message", role: "assistant", status,
                   content: [{type: "output_text", text, annotations: [], logprobs: []}]}
    call item     {id: "fc_...", type: "function_call", call_id, name, arguments, status}
    usage         {input_tokens, input_tokens_details: {cached_tokens, cache_write_tokens: 0},
                   output_tokens,
                   output_tokens_details: {reasoning_tokens: 0}, total_tokens}

:class:`OutputBuilder` turns the chat run's text deltas (through the request's tool-call
parser, ``gateway.domains.chat.tool_calls``, exactly as chat turns them into ``content`` and
``tool_calls``) into output items, and into the events a stream sends, each with ``type``
and ``sequence_number``::

    response.output_item.added      (message)  -> response.content_part.added
    response.output_text.delta ...
    response.output_text.done -> response.content_part.done -> response.output_item.done
    response.output_item.added      (function_call)
    response.function_call_arguments.delta ... -> response.function_call_arguments.done
    response.output_item.done

Text after a call opens a new message item; a run that wrote nothing still has one (empty)
message. The non-streamed answer is built by the same builder with its events dropped.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from loraplex.gateway.domains.chat.tool_calls import ToolCallStreamer
from loraplex.gateway.domains.responses.translate import Translation


def item_id(prefix: str) -> str:
    """A fresh output item id (``msg_`` / ``fc_`` and 32 hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_body(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """The Responses ``usage`` object.

    No reasoning tokens (the model does not reason) and no ``cache_write_tokens`` (prefix
    caching is automatic: nothing is billed as a cache write).
    """
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(
    tr: Translation,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """The Response object (see the module doc).

    Args:
        tr: The request.
        response_id: ``resp_...``.
        created_at: Unix seconds.
        status: ``in_progress``, ``completed``, ``incomplete`` or ``failed``.
        output: The output items so far.
        usage: The usage (None until the run ended).
        error: ``{code, message}`` of a failed response.
        incomplete: Why an incomplete response stopped (``max_output_tokens``).
    """
    b = tr.body
    fmt = (b.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": b.instructions,
        "max_output_tokens": b.max_output_tokens,
        "max_tool_calls": None,
        "model": b.model,
        "output": output,
        "parallel_tool_calls": b.parallel_tool_calls is not False,
        "previous_response_id": b.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": tr.service_tier,
        "store": tr.store,
        "temperature": 1.0 if b.temperature is None else b.temperature,
        "text": {"format": fmt},
        "tool_choice": "auto" if b.tool_choice is None else b.tool_choice,
        "tools": b.tools or [],
        "top_p": 1.0 if b.top_p is None else b.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": b.user,
        "metadata": b.metadata or {},
    }


class OutputBuilder:
    """Output items (and stream events) from one run's text, as it comes.

    Args:
        parser: The request's tool-call parser (None: plain text).
        events: Encode events (streams); False keeps only the items.
    """

    def __init__(self, parser: ToolCallStreamer | None, events: bool) -> None:
        self.parser = parser
        self.events = events
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._text = ""  # its text (message) or arguments (call)

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event: ``event: kind`` and the data with ``type`` and ``sequence_number``."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"

    def feed(self, text: str, finish: str | None) -> list[bytes]:
        """The events for the run's next text (and, with ``finish``, its end).

        Returns:
            Encoded events (empty when ``events`` is off).
        """
        out: list[bytes] = []
        if self.parser is None:
            if text:
                self._content(text, out)
        else:
            deltas = self.parser.feed(text)
            if finish is not None:
                last, finish = self.parser.finish(finish)
                deltas += last
            for delta in deltas:
                if delta.get("content"):
                    self._content(delta["content"], out)
                for call in delta.get("tool_calls", ()):
                    self._call(call, out)
        if finish is not None:
            if not self.output and self._open is None:  # nothing written: one empty message
                self._open_message(out)
            self._close("incomplete" if finish == "length" else "completed", out)
        return out if self.events else []

    def message(self) -> dict[str, Any]:
        """The chat ``assistant`` message the output stands for (a later turn's context)."""
        content = "".join(
            part["text"]
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
        )
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.output
            if item["type"] == "function_call"
        ]
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": calls}

    def _emit(self, out: list[bytes], kind: str, **fields: Any) -> None:
        if self.events:
            out.append(self.event(kind, **fields))

    def _content(self, text: str, out: list[bytes]) -> None:
        if self._open is None or self._open["type"] != "message":
            self._close("completed", out)
            self._open_message(out)
        self._text += text
        self._emit(
            out,
            "response.output_text.delta",
            item_id=self._open["id"],
            output_index=len(self.output),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open_message(self, out: list[bytes]) -> None:
        self._open = {
            "id": item_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self._text = ""
        index = len(self.output)
        self._emit(out, "response.output_item.added", output_index=index, item=self._open)
        self._emit(
            out,
            "response.content_part.added",
            item_id=self._open["id"],
            output_index=index,
            content_index=0,
            part=_text_part(""),
        )

    def _call(self, call: dict[str, Any], out: list[bytes]) -> None:
        arguments = call.get("function", {}).get("arguments", "")
        if "id" in call:  # a new call: its header
            self._close("completed", out)
            self._open = {
                "id": item_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self._text = ""
            self._emit(
                out, "response.output_item.added", output_index=len(self.output), item=self._open
            )
        if arguments and self._open is not None and self._open["type"] == "function_call":
            self._text += arguments
            self._emit(
                out,
                "response.function_call_arguments.delta",
                item_id=self._open["id"],
                output_index=len(self.output),
                delta=arguments,
            )

    def _close(self, status: str, out: list[bytes]) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.output)
        if item["type"] == "message":
            part = _text_part(self._text)
            self._emit(
                out,
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=self._text,
                logprobs=[],
            )
            self._emit(
                out,
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
            item = {**item, "status": status, "content": [part]}
        else:
            self._emit(
                out,
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=self._text,
            )
            item = {**item, "status": status, "arguments": self._text}
        self.output.append(item)
        self._emit(out, "response.output_item.done", output_index=index, item=item)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
