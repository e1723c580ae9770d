"""Issue 27 item 4: malformed messages, tool calls and token ids are 4xx, never 500 or 200.

Roles are OpenAI's; ``content`` may be null only on an assistant message with ``tool_calls``;
``tool_calls[].function.arguments`` is a string holding a JSON object; every token id
(``prompt``, ``stop_token_ids``, ``logit_bias``) is inside the vocabulary before anything is
encoded for the engine core (2**64 was a msgpack overflow, a 500, on the way to a core
process). Hypothesis then throws message lists, tool calls and Completions prompts of every
shape at a live gateway: no 5xx, every 4xx in OpenAI's error body, and every engine request
the gateway does send can be encoded for a core process.
"""

import json

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import wire
from loraplex.gateway.domains.chat.completions import parse_completion_request
from loraplex.gateway.domains.chat.schemas import TOKEN_ID_LIMIT, parse_chat_request
from loraplex.gateway.errors import APIError
from loraplex.gateway.server.build import start_engine
from tests.gateway.live import LiveGateway
from tests.gateway.test_app_basics import assert_openai_error
from tests.media import data_url, photo

MODEL = "tiny-llava"
VOCAB = 1024  # the tiny model's
HI = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "42"}
HUGE = 10**4000  # thousands of digits: still a valid JSON number


def chat_body(messages, **extra):
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1, **extra}).encode()


def completion_body(prompt, **extra):
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}).encode()


def parse_chat(messages, **extra):
    return parse_chat_request(
        chat_body(messages, **extra), max_tokens_limit=64, max_n=8, vocab_size=VOCAB
    )


def refused(parse, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as err:
        parse(*args, **kwargs)
    assert err.value.status == 400, err.value
    return err.value


def call_with(**function):
    return {"role": "assistant", "tool_calls": [{**CALL, "function": function}]}


MALFORMED_MESSAGES = [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "", "content": "hi"}], "messages[0].role"),
    ([{"role": "USER", "content": "hi"}], "messages[0].role"),
    ([{"role": "function", "name": "f", "content": "1"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([HI, {"role": "system", "content": None}], "messages[1].content"),
    ([{"role": "developer", "content": None}], "messages[0].content"),
    ([HI, {"role": "assistant", "content": None}], "messages[1].content"),
    ([HI, {"role": "assistant", "content": None, "tool_calls": []}], "messages[1].content"),
    ([HI, ASKED, {"role": "tool", "tool_call_id": "c1", "content": None}], "messages[2].content"),
    ([HI, ASKED, {"role": "tool", "content": "42"}], "messages[2].tool_call_id"),
    ([HI, ASKED, {"role": "tool", "tool_call_id": 7, "content": "42"}], "messages[2].tool_call_id"),
    ([{"role": "user", "name": ["x"], "content": "hi"}], "messages[0].name"),
    (
        [HI, {"role": "assistant", "content": None, "function_call": {"name": "f"}}],
        "messages[1].function_call",
    ),
    (
        [HI, call_with(name="f", arguments="not json")],
        "messages[1].tool_calls[0].function.arguments",
    ),
    ([HI, call_with(name="f", arguments="")], "messages[1].tool_calls[0].function.arguments"),
    ([HI, call_with(name="f", arguments="[1, 2]")], "messages[1].tool_calls[0].function.arguments"),
    ([HI, call_with(name="f", arguments="null")], "messages[1].tool_calls[0].function.arguments"),
    ([HI, call_with(name="f", arguments="NaN")], "messages[1].tool_calls[0].function.arguments"),
    ([HI, call_with(name="f", arguments={"x": 1})], "messages[1].tool_calls[0].function.arguments"),
    (
        [HI, call_with(name="f", arguments="[" * 5000)],
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        [HI, call_with(name="f", arguments='{"x": ' + "9" * 5000 + "}")],
        "messages[1].tool_calls[0].function.arguments",
    ),
    ([HI, call_with(name="f")], "messages[1].tool_calls[0].function.arguments"),
    ([HI, call_with(name=None, arguments="{}")], "messages[1].tool_calls[0].function.name"),
    ([HI, call_with(arguments="{}")], "messages[1].tool_calls[0].function.name"),
    (
        [HI, {"role": "assistant", "tool_calls": [{**CALL, "type": "retrieval"}]}],
        "messages[1].tool_calls[0].type",
    ),
    (
        [HI, {"role": "assistant", "tool_calls": [{**CALL, "id": 3}]}],
        "messages[1].tool_calls[0].id",
    ),
    (
        [HI, {"role": "assistant", "tool_calls": [{"id": "c"}]}],
        "messages[1].tool_calls[0].function",
    ),
    ([HI, {"role": "assistant", "tool_calls": ["call"]}], "messages[1].tool_calls[0]"),
    ([HI, {"role": "assistant", "tool_calls": {"0": CALL}}], "messages[1].tool_calls"),
    ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("messages", "param"), MALFORMED_MESSAGES)
def test_malformed_messages_are_400_naming_the_field(messages, param):
    assert refused(parse_chat, messages).param == param


@pytest.mark.parametrize(
    "messages",
    [
        [HI],
        [{"role": "developer", "content": "be brief"}, HI],
        [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, HI],
        [HI, ASKED, ANSWER],
        [HI, {"role": "assistant", "tool_calls": [CALL]}, ANSWER],  # content left out
        [HI, {"role": "assistant", "content": "", "tool_calls": [CALL]}, ANSWER],
        [HI, {"role": "assistant", "content": "ok", "name": "bot"}, HI],
        [HI, call_with(name="f", arguments='{"nested": {"a": [1, null, "\\u00e9"]}}'), ANSWER],
        [HI, {"role": "assistant", "tool_calls": [{"function": CALL["function"]}]}, ANSWER],
    ],
)
def test_valid_messages_pass(messages):
    assert parse_chat(messages).messages == messages


OUT_OF_VOCABULARY = [-1, -(2**64), VOCAB, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, HUGE]


@pytest.mark.parametrize("bad", OUT_OF_VOCABULARY)
def test_token_ids_outside_the_vocabulary_are_400_naming_the_field(bad):
    def completion(prompt, **extra):
        return parse_completion_request(
            completion_body(prompt, **extra), max_tokens_limit=64, max_n=8, vocab_size=VOCAB
        )

    for prompt in ([bad], [1, 2, bad], [[3, bad]]):
        assert refused(completion, prompt).param == "prompt"
    assert refused(completion, "hi", stop_token_ids=[5, bad]).param == "stop_token_ids"
    assert refused(parse_chat, [HI], stop_token_ids=[bad]).param == "stop_token_ids"
    if bad >= 0:  # JSON object keys: a '-' is not a token id at all
        key = str(bad)
        assert refused(completion, "hi", logit_bias={key: 1}).param == "logit_bias"
        assert refused(parse_chat, [HI], logit_bias={key: 1}).param == "logit_bias"


def test_an_unknown_vocabulary_still_bounds_ids_by_int64():
    def completion(prompt, **extra):
        body = completion_body(prompt, **extra)
        return parse_completion_request(body, max_tokens_limit=64, max_n=8)  # vocab_size 0

    assert completion([TOKEN_ID_LIMIT - 1]).prompt == [TOKEN_ID_LIMIT - 1]
    for bad in (TOKEN_ID_LIMIT, 2**64, HUGE, -1):
        assert refused(completion, [bad]).param == "prompt"
        assert refused(completion, "x", stop_token_ids=[bad]).param == "stop_token_ids"
    assert completion([0, VOCAB - 1]).prompt == [0, VOCAB - 1]


# ----------------------------------------------------------------------- a live gateway
@pytest.fixture
def sent(engine_client, monkeypatch):
    """Every engine request the gateway sends, each first encoded and decoded as it would
    cross to an engine core process (an overflow or a type the wire refuses fails the test)."""
    requests = []
    generate = engine_client.generate
    encode, decode = wire.encoder().encode, wire.core_decoder().decode

    def spy(request):
        decode(encode(wire.AddRequest(request)))
        requests.append(request)
        return generate(request)

    monkeypatch.setattr(engine_client, "generate", spy)
    return requests


@pytest.fixture
def tenant_key(live):
    return live.create_tenant("schema")["api_key"]


def post(live, key, path, body):
    with live.client(key) as c:
        return c.post(path, content=body, headers={"content-type": "application/json"})


def test_the_issues_cases_are_400_before_the_engine(live, tenant_key, sent):
    cases = [
        ("/v1/completions", completion_body([2**64]), "prompt"),
        ("/v1/completions", completion_body([2**63]), "prompt"),
        ("/v1/completions", completion_body([HUGE]), "prompt"),
        ("/v1/completions", completion_body("hi", stop_token_ids=[2**64]), "stop_token_ids"),
        ("/v1/completions", completion_body("hi", logit_bias={"999999999999": 1}), "logit_bias"),
        ("/v1/chat/completions", chat_body([{"role": "wizard", "content": "hi"}]), None),
        ("/v1/chat/completions", chat_body([{"role": "user", "content": None}]), None),
        (
            "/v1/chat/completions",
            chat_body([HI, call_with(name="f", arguments="not json"), ANSWER]),
            "messages[1].tool_calls[0].function.arguments",
        ),
    ]
    for path, body, param in cases:
        err = assert_openai_error(post(live, tenant_key, path, body), 400)
        assert err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] == param, err
    assert sent == []  # none reached the engine
    r = post(live, tenant_key, "/v1/chat/completions", chat_body([HI, ASKED, ANSWER]))
    assert r.status_code == 200, r.text
    r = post(live, tenant_key, "/v1/completions", completion_body([1, VOCAB - 1]))
    assert r.status_code == 200, r.text
    assert len(sent) == 2


def test_tokenize_refuses_the_same_messages(live, tenant_key):
    body = json.dumps({"model": MODEL, "messages": [HI, call_with(name="f", arguments="{")]})
    err = assert_openai_error(post(live, tenant_key, "/tokenize", body.encode()), 400)
    assert err["param"] == "messages[1].tool_calls[0].function.arguments"
    body = json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    err = assert_openai_error(post(live, tenant_key, "/tokenize", body.encode()), 400)
    assert err["param"] == "messages[0].role"


# ----------------------------------------------------------------------------- hypothesis
SPECIAL_INTS = st.sampled_from(
    [0, -1, VOCAB - 1, VOCAB, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, HUGE]
)
INTS = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), SPECIAL_INTS)
TEXT = st.text(max_size=12)  # any unicode but lone surrogates (not valid JSON)
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), TEXT
)
GARBAGE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
IMAGE = data_url(photo("astronaut", 24))
URLS = st.sampled_from(
    [IMAGE, "data:image/png;base64,AAAA", "data:,", "https://example.com/x.png", "", "data:"]
)
PARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXT, GARBAGE)}),
    st.fixed_dictionaries(
        {"type": st.just("image_url")},
        optional={
            "image_url": st.one_of(
                st.fixed_dictionaries(
                    {"url": st.one_of(URLS, GARBAGE)}, optional={"detail": st.one_of(TEXT, SCALARS)}
                ),
                URLS,
                GARBAGE,
            )
        },
    ),
    st.fixed_dictionaries({"type": st.one_of(TEXT, GARBAGE)}, optional={"text": TEXT}),
    GARBAGE,
)
CONTENT = st.one_of(st.none(), TEXT, st.lists(PARTS, max_size=3), GARBAGE)
ARGUMENTS = st.one_of(
    st.sampled_from(['{"x": 1}', "{}", "not json", "[1]", "null", "", "{", "[" * 3000]),
    st.just('{"x": ' + "9" * 5000 + "}"),
    GARBAGE.map(json.dumps),
    TEXT,
    GARBAGE,
)
FUNCTION = st.one_of(
    st.fixed_dictionaries(
        {}, optional={"name": st.one_of(st.just("f"), TEXT, GARBAGE), "arguments": ARGUMENTS}
    ),
    GARBAGE,
)
TOOL_CALL = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "id": st.one_of(TEXT, GARBAGE),
            "type": st.one_of(st.just("function"), TEXT, GARBAGE),
            "function": FUNCTION,
        },
    ),
    GARBAGE,
)
ROLES = st.one_of(
    st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bot"]),
    TEXT,
    GARBAGE,
)
ANY_MESSAGE = st.tuples(
    st.fixed_dictionaries(
        {"role": ROLES},
        optional={
            "content": CONTENT,
            "tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2), GARBAGE),
            "tool_call_id": st.one_of(TEXT, GARBAGE),
            "name": st.one_of(TEXT, GARBAGE),
            "function_call": GARBAGE,
        },
    ),
    st.dictionaries(TEXT, GARBAGE, max_size=1),  # a field no schema names
).map(lambda pair: {**pair[1], **pair[0]})
# Messages of the right shape (the template, the tool calls and the images do run), with the
# arguments still sometimes wrong.
GOOD_CONTENT = st.one_of(
    TEXT,
    st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), min_size=1, max_size=2
    ),
    st.just([{"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": "?"}]),
)
GOOD_CALL = st.fixed_dictionaries(
    {
        "id": TEXT,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.sampled_from(["f", "g"]),
                "arguments": st.one_of(
                    st.dictionaries(TEXT, SCALARS, max_size=2).map(json.dumps), ARGUMENTS
                ),
            }
        ),
    }
)
GOOD_MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": GOOD_CONTENT,
        },
        optional={"name": TEXT},
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(st.none(), TEXT),
            "tool_calls": st.lists(GOOD_CALL, min_size=1, max_size=2),
        }
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": TEXT, "content": GOOD_CONTENT}),
)
MESSAGES = st.one_of(
    st.lists(GOOD_MESSAGE, min_size=1, max_size=4),
    st.lists(st.one_of(GOOD_MESSAGE, ANY_MESSAGE), min_size=1, max_size=4),
    st.lists(st.one_of(ANY_MESSAGE, GARBAGE), max_size=4),
    GARBAGE,
)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
EXTRAS = st.fixed_dictionaries(
    {},
    optional={
        "tools": st.one_of(st.just(TOOLS), GARBAGE),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), GARBAGE),
        "stop_token_ids": st.one_of(st.lists(INTS, max_size=3), GARBAGE),
        "logit_bias": st.one_of(st.dictionaries(st.one_of(INTS.map(str), TEXT), SCALARS), GARBAGE),
    },
)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def assert_not_a_server_error(response):
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)


@pytest.mark.slow
@FUZZ
@given(messages=MESSAGES, extra=EXTRAS)
def test_no_message_list_or_tool_call_is_a_server_error(live, tenant_key, sent, messages, extra):
    body = msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 1, **extra})
    assert_not_a_server_error(post(live, tenant_key, "/v1/chat/completions", body))


PROMPTS = st.one_of(
    TEXT,
    st.lists(INTS, max_size=5),
    st.lists(st.lists(INTS, max_size=3), max_size=2),
    st.lists(TEXT, max_size=2),
    st.lists(st.one_of(INTS, TEXT, GARBAGE), max_size=3),
    GARBAGE,
)


@pytest.mark.slow
@FUZZ
@given(prompt=PROMPTS, extra=EXTRAS)
def test_no_completions_prompt_is_a_server_error(live, tenant_key, sent, prompt, extra):
    extra.pop("tools", None)
    extra.pop("tool_choice", None)
    body = msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra})
    assert_not_a_server_error(post(live, tenant_key, "/v1/completions", body))


# ------------------------------------------------------------------ an engine core process
@pytest.fixture(scope="module")
def core_process(tiny_text_dir, tmp_path_factory):
    config = EngineConfig(model=tiny_text_dir, served_model_name="tiny", num_kv_blocks=64)
    client = start_engine(config, tmp_path_factory.mktemp("store"), in_process=False)
    yield client
    client.shutdown()


@pytest.mark.slow
def test_a_core_process_gets_no_out_of_range_id(core_process, tmp_path):
    """What the issue saw: 2**64 in a token-id prompt was a msgpack overflow, a 500."""
    assert core_process.input_limits.vocab_size == VOCAB
    with LiveGateway(core_process, tmp_path / "data") as gw:
        key = gw.create_tenant("proc")["api_key"]
        with gw.client(key) as c:
            for extra in (
                {"prompt": [2**64]},
                {"prompt": [HUGE]},
                {"prompt": "hi", "stop_token_ids": [2**64]},
                {"prompt": "hi", "logit_bias": {str(VOCAB): 1}},
            ):
                r = c.post("/v1/completions", json={"model": "tiny", "max_tokens": 1, **extra})
                err = assert_openai_error(r, 400)
                assert err["param"] in ("prompt", "stop_token_ids", "logit_bias"), err
            r = c.post("/v1/completions", json={"model": "tiny", "max_tokens": 1, "prompt": [1]})
            assert r.status_code == 200, r.text
