from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.client.stop import StopChecker


def feed(checker, deltas):
    return [checker.append(d) for d in deltas]


def test_stop_spanning_deltas_is_cut_and_never_emitted():
    c = StopChecker(["###"])
    assert feed(c, ["a#", "#", "#b"]) == ["", "a", ""]
    assert c.matched == "###" and c.text == "a" and c.flush() == ""
    assert c.append("more") == ""


def test_include_stop_str_in_output_keeps_it_and_cuts_after():
    c = StopChecker(["###"], include_stop_str_in_output=True)
    assert feed(c, ["a#", "#", "#b"]) == ["a#", "#", "#"]
    assert c.text == "a###" and c.matched == "###"


def test_hold_back_releases_when_no_stop_follows():
    c = StopChecker(["END"])
    assert feed(c, ["EN", "X", "yz"]) == ["", "E", "NX"]
    assert c.held_back == 2
    assert c.flush() == "yz"
    assert c.text == "ENXyz" and c.matched is None


def test_hold_back_is_longest_stop_minus_one():
    c = StopChecker(["a", "abcd"])
    assert c.append("xyzw") == "x"
    assert c.held_back == 3


def test_no_stops_streams_everything():
    c = StopChecker()
    assert feed(c, ["ab", "", "c"]) == ["ab", "", "c"]


def test_first_ending_match_wins():
    c = StopChecker(["abcd", "bc"])
    c.append("xabcd")
    assert c.matched == "bc" and c.text == "xa"


def test_same_end_prefers_longest():
    c = StopChecker(["c", "bc"])
    c.append("abc")
    assert c.matched == "bc" and c.text == "a"


def test_stop_at_start_gives_empty_output():
    c = StopChecker(["\n"])
    assert c.append("\nhello") == "" and c.text == ""


def expected_cut(text, stops, include):
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab#\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_streamed_text_equals_cut_text(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    c = StopChecker(stops, include_stop_str_in_output=include)
    out = "".join(feed(c, deltas)) + c.flush()
    want, matched = expected_cut(text, stops, include)
    assert out == want == c.text
    assert c.matched == matched
