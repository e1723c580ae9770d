import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.client.detokenizer import IncrementalDetokenizer, TextStream, _OffsetStream
from loraplex.engine.sampling import SamplingParams
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
    """Every delta of ``ids``, the last one the flush at finish (as the output processor does)."""
    detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=skip))
    deltas = [detok.append(i) for i in ids]
    deltas.append(detok.finish())
    assert detok.finished and detok.stop_matched is None
    return deltas, detok


@settings(deadline=None, max_examples=150, suppress_health_check=HC)
@given(data=st.data(), skip=st.booleans(), slow=st.booleans())
def test_concatenated_deltas_equal_decode_random_ids(any_tokenizer, data, skip, slow):
    tokenizer = any_tokenizer
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=25))
    tok = SlowTokenizer(tokenizer) if slow else tokenizer
    deltas, detok = stream_all(tok, ids, skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip) == detok.text


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
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    out, detok = run(tokenizer, ids, **params.__dict__)
    want, matched = expected_cut(tokenizer.decode(ids), stops, include)
    assert out == want == detok.text
    assert detok.stop_matched == matched


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


def run(tokenizer, text_ids, stop_token_at=None, **kw):
    """Append until a stop string ends the text, then finish, as the output processor does.

    ``stop_token_at``: the index of the token the core finished the sequence on (EOS or a stop
    token id), whose text is left out unless ``include_stop_str_in_output``.
    """
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(**kw))
    out = ""
    for k, i in enumerate(text_ids):
        out += detok.append(i, stop_token=k == stop_token_at)
        if detok.finished or k == stop_token_at:
            break
    return out + detok.finish(), detok


def test_a_stop_tokens_text_is_left_out_unless_asked_for(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello") + [eos] + tokenizer.encode("world")
    at = ids.index(eos)
    out, d = run(tokenizer, ids, stop_token_at=at, skip_special_tokens=False)
    assert out == "hello" and d.token_ids[-1] == eos and d.stop_matched is None
    out, _ = run(
        tokenizer, ids, stop_token_at=at, skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert out == "hello<|eos|>"
    stop_id = tokenizer.encode("!")[0]
    hello = tokenizer.encode("hello")
    out, _ = run(tokenizer, hello + [stop_id], stop_token_at=len(hello))
    assert out == "hello"
    out, _ = run(
        tokenizer, hello + [stop_id], stop_token_at=len(hello), include_stop_str_in_output=True
    )
    assert out == "hello!"


def test_a_special_token_that_is_not_a_stop_token_is_text(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id] + tokenizer.encode("world")
    assert run(tokenizer, ids)[0] == "helloworld"  # ignore_eos: the core ran past it
    assert run(tokenizer, ids, skip_special_tokens=False)[0] == "hello<|eos|>world"


def test_stop_string_across_tokens(tokenizer):
    ids = [i for ch in "say ### END" for i in tokenizer.encode(ch)]  # one char per step
    out, d = run(tokenizer, ids, stop=["###"])
    assert (out, d.stop_matched, d.text) == ("say ", "###", "say ")
    assert d.token_ids == ids[: len("say ###")]  # nothing appended past the match
    out, d = run(tokenizer, ids, stop=["###"], include_stop_str_in_output=True)
    assert out == "say ###" and d.stop_matched == "###"


def test_partial_stop_is_held_back_then_released(tokenizer):
    ids = [i for ch in "a##b" for i in tokenizer.encode(ch)]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["###"]))
    deltas, texts = [], []
    for i in ids:
        deltas.append(detok.append(i))
        texts.append(detok.text)
    assert deltas == ["", "", "a", "#"]  # up to 2 characters may start "###"
    assert texts == ["", "", "a", "a#"]  # .text holds only what was streamed
    assert detok.finish() == "#b" and detok.text == "a##b" and detok.stop_matched is None


def test_stop_in_text_released_at_finish_counts_as_stop(tokenizer):
    # The first byte of a multi-token character decodes to nothing until finish.
    first_byte = next(ids[0] for ids in map(tokenizer.encode, "😀🎉日") if len(ids) > 1)
    out, d = run(tokenizer, tokenizer.encode("x") + [first_byte], stop=["\ufffd"])
    assert out == "x" and d.stop_matched == "\ufffd"


def test_finish_and_append_after_finish(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["zzzz"]))
    assert detok.append(tokenizer.encode("hi")[0]) == ""
    assert detok.finish() == tokenizer.decode(detok.token_ids)  # held back till now
    assert detok.finish() == ""
    assert detok.finished and detok.text == tokenizer.decode(detok.token_ids)
    with pytest.raises(RuntimeError, match="finished"):
        detok.append(5)
