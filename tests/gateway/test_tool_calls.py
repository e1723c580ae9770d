"""The tool-call parser: Hermes ``<tool_call>`` text, streamed in any split, folds to the same
message as parsed whole; named and required outputs become calls."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.models.tiny_tokenizer import LLAVA_CHAT_TEMPLATE
from loraplex.engine.structured_output.tool_call_format import HermesFormat, detect_tool_call_format
from loraplex.gateway.domains.chat.tool_calls import ToolCallStreamer, fold

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TEXT = "Let me look.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome") + "\n"


def auto(parallel=True):
    return ToolCallStreamer(
        mode="auto", functions=frozenset({"get_weather"}), fmt=HermesFormat(), parallel=parallel
    )


def run(streamer, pieces, finish="stop"):
    deltas = []
    for p in pieces:
        deltas += streamer.feed(p)
    last, reason = streamer.finish(finish)
    return fold(deltas + last), reason, deltas + last


def test_auto_parses_hermes_calls_and_keeps_the_rest_as_content():
    message, reason, _ = run(auto(), [TEXT])
    assert reason == "tool_calls"
    assert message["content"] == "Let me look."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Oslo"},
        {"city": "Rome"},
    ]
    assert len({c["id"] for c in calls}) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_any_split_of_the_stream_folds_to_the_same_message(cuts):
    cuts = sorted(set(cuts))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
    message, reason, deltas = run(auto(), pieces)
    whole, _, _ = run(auto(), [TEXT])
    for m in (message, whole):
        for c in m["tool_calls"]:
            c.pop("id")
    assert (message, reason) == (whole, "tool_calls")
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert "<tool_call" not in streamed  # a marker is never streamed as content


def test_unknown_functions_broken_json_and_cut_calls_stay_content():
    for text in (
        CALL.replace("get_weather", "rm_rf"),
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "get_weather", "argu',
    ):
        message, reason, _ = run(auto(), [text], finish="length")
        assert "tool_calls" not in message and message["content"] == text
        assert reason == "length"


def test_parallel_tool_calls_false_keeps_one_call():
    message, _, _ = run(auto(parallel=False), [TEXT])
    assert len(message["tool_calls"]) == 1


def test_plain_text_passes_through_with_a_held_back_marker_prefix():
    s = auto()
    assert s.feed("hello <tool") == [{"content": "hello"}]
    assert s.feed("box \n") == [{"content": " <toolbox"}]
    assert s.finish("stop") == ([{"content": " \n"}], "stop")  # all of the text, in order


def test_named_streams_arguments_and_required_parses_the_array():
    named = ToolCallStreamer(mode="named", functions=frozenset({"f"}), name="f")
    message, reason, deltas = run(named, ['{"a": ', "1}"])
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert deltas[0]["tool_calls"][0]["function"]["arguments"] == ""  # the header first
    required = ToolCallStreamer(mode="required", functions=frozenset({"f", "g"}))
    text = '[{"name": "g", "parameters": {}}, {"name": "f", "parameters": {"a": 2}}]'
    message, reason, _ = run(required, [text[:10], text[10:]])
    assert reason == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("g", "{}"),
        ("f", '{"a": 2}'),
    ]


@pytest.mark.parametrize("finish", ["length", "stop"])  # max_tokens, or a stop string
def test_a_forced_call_the_grammar_did_not_complete_is_neither_a_call_nor_content(finish):
    cut = ToolCallStreamer(mode="required", functions=frozenset({"f"}))
    message, reason, deltas = run(cut, ['[{"name": "f", "par'], finish=finish)
    assert reason == finish and deltas == []  # nothing of the grammar's text is sent
    assert not message["content"] and "tool_calls" not in message
    whole = ToolCallStreamer(mode="required", functions=frozenset({"f"}))
    assert whole.message('[{"name": "f", "par', finish) == (
        {"role": "assistant", "content": None},
        finish,
    )
    named = ToolCallStreamer(mode="named", functions=frozenset({"f"}), name="f")
    assert named.message('{"a": 1, "b"', finish) == ({"role": "assistant", "content": None}, finish)
    streamed = ToolCallStreamer(mode="named", functions=frozenset({"f"}), name="f")
    _, reason, deltas = run(streamed, ['{"a": 1, "b"'], finish=finish)
    assert reason == finish  # never "tool_calls": the deltas sent are not a whole call
    assert all("content" not in d for d in deltas)
    done = ToolCallStreamer(mode="named", functions=frozenset({"f"}), name="f")
    message, reason = done.message('{"a": 1}', "stop")
    assert (
        reason == "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    )


def test_the_format_is_found_from_the_template():
    assert detect_tool_call_format(LLAVA_CHAT_TEMPLATE) == "hermes"
    assert detect_tool_call_format("{{ messages }}") is None
    assert detect_tool_call_format(None) is None
