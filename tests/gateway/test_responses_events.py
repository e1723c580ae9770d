"""Responses stream events from a scripted run, each validated against the ``openai`` SDK's
own pydantic event types: text, a function call after text, and a failure mid-stream
(``error`` then ``response.failed``)."""

import asyncio

import msgspec
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from loraplex.engine.request import CompletionOutput, RequestOutput
from loraplex.gateway.domains.chat.tool_calls import ToolCallStreamer
from loraplex.gateway.domains.responses.events import event_stream
from loraplex.gateway.domains.responses.translate import check_body, translate
from loraplex.gateway.errors import APIError

EVENT = TypeAdapter(ResponseStreamEvent)


class _Ledger:
    prompt_tokens, completion_tokens, cached_tokens = 7, 3, 0


class ScriptedRun:
    """The parts of ``ChatRun`` a stream uses; ``next`` plays the script."""

    def __init__(self, script):
        self.script = list(script)
        self.ledger = _Ledger()
        self.cancelled = None

    def next_nowait(self):
        return None

    async def next(self):
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self, reason):
        self.cancelled = reason

    async def durable(self, strict=True):
        return None


def _out(text, finish=None):
    choice = CompletionOutput(index=0, text=text, token_ids=[1], finish_reason=finish)
    return RequestOutput("r", [1] * 7, [choice], finished=finish is not None)


def _events(script, parser=None, **body):
    tr = translate(check_body({"model": "m", "input": "hi", **body}, 100), [], 100)
    run = ScriptedRun(script[1:])
    saved = []

    async def save(response, builder):
        saved.append((response, builder.message()))

    async def collect():
        chunks = []
        gen = event_stream(run, script[0], tr, "resp_" + "a" * 32, parser, None, save)
        async for chunk in gen:
            chunks.append(bytes(chunk))
        return b"".join(chunks)

    raw = asyncio.run(collect())
    events = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = EVENT.validate_python(msgspec.json.decode(data[len("data: ") :]))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, saved


def test_text_then_completed():
    events, saved = _events([_out("Hel"), _out("lo", "stop")])
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert final.output_text == "Hello" and final.usage.total_tokens == 10
    assert saved[0][1] == {"role": "assistant", "content": "Hello"}


def test_text_then_a_call_are_two_items():
    parser = ToolCallStreamer(mode="named", functions=frozenset({"f"}), name="f")
    # named mode: the whole text is the arguments; a header first
    events, saved = _events([_out('{"a":'), _out(" 1}", "stop")], parser=parser)
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds.count("response.function_call_arguments.delta") == 2
    final = events[-1].response
    [call] = final.output
    assert call.arguments == '{"a": 1}' and call.name == "f" and call.status == "completed"
    assert saved[0][1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_length_is_incomplete():
    events, _ = _events([_out("abc", "length")], max_output_tokens=1)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"


@pytest.mark.parametrize("status", [503, 500])
def test_a_failure_mid_stream_ends_with_error_and_failed(status):
    boom = APIError(status, "the engine is not running", code="engine_unavailable")
    events, saved = _events([_out("Hel"), boom])
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "engine_unavailable"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == "the engine is not running"
    assert saved == []  # a failed response is not stored
