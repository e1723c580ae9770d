import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.sampling import IncrementalDetokenizer, SamplingParams, TextStream
from loraplex.engine.sampling.detokenizer import _OffsetStream
from tests.sampling.test_stop import expected_cut

HC = [HealthCheck.function_scoped_fixture]
CHARS = list("abc xyz.,!\n") + list("éüñçø日本語中文字東京😀🎉👍🏽❤️🚀€∞") + ["\u200d"]
TEXT = st.text(alphabet=st.sampled_from(CHARS), max_size=30)


class SlowTokenizer:
    """Only ``decode``: forces the Python prefix / read-offset path."""

    def __init__(self, fast):
        self.fast = fast
        self.eos_token_id = fast.eos_token_id
        self.all_special_ids = fast.all_special_ids

    def decode(self, ids, skip_special_tokens=False):
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        return self.fast.convert_ids_to_tokens(ids)


def stream_all(tok, ids, skip=True):
    params = SamplingParams(max_tokens=max(len(ids), 1), skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, params, eos_token_ids=())
    deltas = [detok.append(i) for i in ids]
    assert detok.finish_reason == ("length" if ids else None)
    return deltas, detok


@settings(deadline=None, max_examples=150, suppress_health_check=HC)
@given(data=st.data(), skip=st.booleans(), slow=st.booleans())
def test_concatenated_deltas_equal_decode_random_ids(any_tokenizer, data, skip, slow):
    tokenizer = any_tokenizer
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=25))
    tok = SlowTokenizer(tokenizer) if slow else tokenizer
    deltas, detok = stream_all(tok, ids, skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip) == detok.output_text


@settings(deadline=None, max_examples=100, suppress_health_check=HC)
@given(text=TEXT, slow=st.booleans())
def test_streaming_real_text_never_splits_a_character(any_tokenizer, text, slow):
    tokenizer = any_tokenizer
    ids = tokenizer.encode(text)
    if not ids:
        return
    tok = SlowTokenizer(tokenizer) if slow else tokenizer
    deltas, _ = stream_all(tok, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    if tokenizer.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel":
        assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(deadline=None, max_examples=100, suppress_health_check=HC)
@given(
    text=TEXT,
    stops=st.lists(st.text(alphabet=st.sampled_from(CHARS), min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
)
def test_streamed_text_with_stops_equals_cut_decode(any_tokenizer, text, stops, include):
    tokenizer = any_tokenizer
    ids = tokenizer.encode(text)
    if not ids:
        return
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=len(ids))
    detok = IncrementalDetokenizer(tokenizer, params, eos_token_ids=())
    out = ""
    for i in ids:
        out += detok.append(i)
        if detok.finished:
            break
    want, matched = expected_cut(tokenizer.decode(ids), stops, include)
    assert out == want == detok.output_text
    assert detok.stop_reason == matched
    assert detok.finish_reason == ("stop" if matched else "length")


def test_multibyte_emoji_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("a😀b")
    assert len(ids) > 3  # the emoji takes several byte-level tokens
    stream = TextStream(tokenizer)
    deltas = [stream.step(i) for i in ids]
    assert deltas[0] == "a" and "😀" in "".join(deltas) and "" in deltas
    assert [d for d in deltas if d] in (["a", "😀", "b"], ["a", "😀b"])


def test_dangling_bytes_are_released_at_finish(tokenizer):
    emoji = tokenizer.encode("😀")
    ids = tokenizer.encode("ok") + emoji[:-1]
    deltas, detok = stream_all(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) and deltas[-1].endswith("\ufffd")


def test_byte_fallback_run_is_held_until_it_is_closed(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    vocab = tok.get_vocab()
    e6, b8 = vocab["<0xE6>"], vocab["<0xB8>"]
    z = vocab["<0x5A>"]  # "Z" as a byte token: valid alone, but part of an invalid run below
    ids = tok.encode("ok") + [z, e6, b8] + tok.encode("ok")
    stream = TextStream(tok)
    deltas = [stream.step(i) for i in ids]
    assert "".join(deltas) + stream.flush() == tok.decode(ids) == "ok\ufffd\ufffd\ufffd ok"
    # A skipped special token is invisible to the decoder: the bytes around it are one run.
    ids = [z, tok.eos_token_id, e6, tok.bos_token_id] + tok.encode("ok")
    for skip in (True, False):
        stream = TextStream(tok, skip_special_tokens=skip)
        deltas = [stream.step(i) for i in ids]
        assert "".join(deltas) + stream.flush() == tok.decode(ids, skip_special_tokens=skip)


def test_decode_stream_failure_falls_back_to_offsets(tokenizer):
    stream = TextStream(tokenizer)

    class Boom:
        def step(self, *_):
            raise RuntimeError("invalid prefix")

    ids = tokenizer.encode("café 日本 😀 ok")
    out = [stream.step(i) for i in ids[:3]]
    stream._ds = Boom()
    out += [stream.step(i) for i in ids[3:]]
    assert "".join(out) + stream.flush() == "café 日本 😀 ok"
    assert isinstance(stream._offsets, _OffsetStream)


def run(tokenizer, text_ids, eos=None, **kw):
    params = SamplingParams(**({"max_tokens": 100} | kw))
    args = () if eos is None else (eos,)
    detok = IncrementalDetokenizer(tokenizer, params, *args)
    out = ""
    for i in text_ids:
        out += detok.append(i)
        if detok.finished:
            break
    return out, detok


def test_eos_stops_and_its_text_is_left_out(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello") + [eos] + tokenizer.encode("world")
    out, d = run(tokenizer, ids, skip_special_tokens=False)
    assert (out, d.finish_reason, d.stop_reason) == ("hello", "stop", None)
    assert d.token_ids[-1] == eos
    out, d = run(tokenizer, ids, skip_special_tokens=False, include_stop_str_in_output=True)
    assert out == "hello<|eos|>"


def test_ignore_eos_keeps_going(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id] + tokenizer.encode("world")
    out, d = run(tokenizer, ids, ignore_eos=True, max_tokens=len(ids))
    assert out == "helloworld" and d.finish_reason == "length"
    out, d = run(tokenizer, ids, ignore_eos=True, skip_special_tokens=False, max_tokens=len(ids))
    assert out == "hello<|eos|>world"


def test_explicit_eos_ids_and_stop_token_ids(tokenizer):
    hello = tokenizer.encode("hello")
    out, d = run(tokenizer, hello + [2, 5], eos=[2])
    assert (out, d.finish_reason, d.stop_reason) == ("hello", "stop", None)
    stop_id = tokenizer.encode("!")[0]
    out, d = run(tokenizer, hello + [stop_id] + hello, stop_token_ids=[stop_id])
    assert (out, d.finish_reason, d.stop_reason) == ("hello", "stop", stop_id)
    out, d = run(
        tokenizer, hello + [stop_id], stop_token_ids=[stop_id], include_stop_str_in_output=True
    )
    assert out == "hello!"


def test_max_tokens_gives_length(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    out, d = run(tokenizer, ids, max_tokens=3)
    assert d.finish_reason == "length" and d.stop_reason is None
    assert len(d.token_ids) == 3 and out == tokenizer.decode(ids[:3])


def test_stop_string_across_tokens(tokenizer):
    ids = [i for ch in "say ### END" for i in tokenizer.encode(ch)]  # one char per step
    out, d = run(tokenizer, ids, stop=["###"])
    assert (out, d.finish_reason, d.stop_reason, d.output_text) == ("say ", "stop", "###", "say ")
    out, d = run(tokenizer, ids, stop=["###"], include_stop_str_in_output=True)
    assert out == "say ###" and d.finish_reason == "stop"


def test_partial_stop_is_held_back_then_released(tokenizer):
    ids = [i for ch in "a##b" for i in tokenizer.encode(ch)]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["###"], max_tokens=4))
    deltas, texts = [], []
    for i in ids:
        deltas.append(detok.append(i))
        texts.append(detok.text)
    assert deltas == ["", "", "a", "##b"]  # last one flushed by max_tokens
    assert texts == ["", "", "a", "a##b"]  # .text holds only what was streamed
    assert detok.finish_reason == "length" and detok.output_text == "a##b"


def test_stop_in_text_released_at_finish_counts_as_stop(tokenizer):
    # The first byte of a multi-token character decodes to nothing until finish.
    first_byte = next(ids[0] for ids in map(tokenizer.encode, "😀🎉日") if len(ids) > 1)
    ids = tokenizer.encode("x") + [first_byte]
    out, d = run(tokenizer, ids, stop=["\ufffd"], max_tokens=2)
    assert out == "x" and d.finish_reason == "stop" and d.stop_reason == "\ufffd"


def test_finish_and_append_after_finish(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["zzzz"]))
    assert detok.append(tokenizer.encode("hi")[0]) == ""
    assert detok.finish("abort") == tokenizer.decode(detok.token_ids)  # held back till now
    assert detok.finish() == ""
    assert detok.finish_reason == "abort" and detok.output_text == tokenizer.decode(detok.token_ids)
    with pytest.raises(RuntimeError, match="finished"):
        detok.append(5)


def test_prompt_token_ids_are_accepted_and_do_not_change_the_text(tokenizer):
    ids = tokenizer.encode(" world")
    params = SamplingParams(max_tokens=len(ids))
    detok = IncrementalDetokenizer(tokenizer, params, prompt_token_ids=tokenizer.encode("hi"))
    assert "".join(detok.append(i) for i in ids) == " world" == detok.text
