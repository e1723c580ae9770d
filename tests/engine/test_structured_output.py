"""Structured output (engine/structured_output/grammar.py): every constrained output parses and
validates against its schema (checked with ``jsonschema``), in batches that mix constrained and
free rows, forks, preemption and the prefix cache; what cannot be enforced is refused."""

import json
import re

import jsonschema
import pytest
import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.structured_output.grammar import (
    MAX_SPEC_CHARS,
    StructuredOutputError,
    StructuredOutputSpec,
    apply_token_bitmasks,
)

from .conftest import long_text

# Bounded strings, arrays and integers: the built-in model has random weights, so an unbounded
# string could run to max_tokens before its closing quote.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
LIST_OF_POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"const": 0}},
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 4,
}


@pytest.fixture(scope="module")
def llm(tiny_llava_dir, make_llm):
    return make_llm(model=tiny_llava_dir, num_kv_blocks=256)


def msgs(text="Reply in JSON."):
    return [{"role": "user", "content": text}]


def schema_params(schema, **kw):
    kw.setdefault("max_tokens", 160)
    return SamplingParams(structured_output=StructuredOutputSpec.json_schema(schema), **kw)


def assert_clean(llm):
    assert llm.engine.kv.pool.num_used == 0
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_constrained_rows_validate_in_a_batch_with_free_rows(llm):
    free_alone = llm.generate(
        [
            llm.make_request(
                msgs("hello"), SamplingParams(temperature=0, max_tokens=24), request_id="f"
            )
        ]
    )[0]
    requests = [
        llm.make_request(msgs(), schema_params(PERSON, temperature=0), request_id="greedy"),
        llm.make_request(
            msgs("hello"), SamplingParams(temperature=0, max_tokens=24), request_id="free"
        ),
        llm.make_request(
            msgs(), schema_params(PERSON, temperature=1.0, seed=7), request_id="seeded"
        ),
        llm.make_request(
            msgs(long_text(30)),
            schema_params(LIST_OF_POINTS, temperature=0.8, seed=3, n=3),
            request_id="fork",
        ),
        llm.make_request(
            msgs(), schema_params(PERSON, temperature=1.2, seed=11, top_p=0.9), request_id="p"
        ),
    ]
    outs = {o.request_id: o for o in llm.generate(requests)}
    # The free row is untouched by its constrained neighbours.
    assert outs["free"].outputs[0].token_ids == free_alone.outputs[0].token_ids
    checked = 0
    for rid, schema in (
        ("greedy", PERSON),
        ("seeded", PERSON),
        ("fork", LIST_OF_POINTS),
        ("p", PERSON),
    ):
        for choice in outs[rid].outputs:
            assert choice.finish_reason == "stop", (rid, choice.text)
            jsonschema.validate(json.loads(choice.text), schema)
            checked += 1
    assert checked == 6
    assert len({c.text for c in outs["fork"].outputs}) > 1  # the forks sampled apart
    assert_clean(llm)


def test_a_constrained_request_gives_the_same_tokens_alone_and_batched(llm):
    params = schema_params(PERSON, temperature=1.0, seed=99)
    alone = llm.generate([llm.make_request(msgs(), params, request_id="a")])[0].outputs[0]
    others = [
        llm.make_request(
            msgs(long_text(20 + i, seed=i)),
            SamplingParams(temperature=1.0, max_tokens=10),
            request_id=f"o{i}",
        )
        for i in range(3)
    ]
    batch = others[:1] + [llm.make_request(msgs(), params, request_id="b")] + others[1:]
    batched = {o.request_id: o for o in llm.generate(batch)}["b"].outputs[0]
    assert batched.token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), PERSON)


def test_prefix_cache_and_preemption_keep_the_grammar(tiny_llava_dir):
    small = LLM(EngineConfig(model=tiny_llava_dir, num_kv_blocks=24, max_num_seqs=8))
    prompt = msgs(long_text(60, seed=5))
    params = schema_params(PERSON, temperature=1.0, seed=5, max_tokens=120)
    first = small.generate([small.make_request(prompt, params, request_id="r0")])[0]
    again = small.generate([small.make_request(prompt, params, request_id="r1")])[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Eight long constrained requests in a 24-block pool: some are preempted and recomputed.
    crowd = [
        small.make_request(
            msgs(long_text(50, seed=s)),
            schema_params(PERSON, temperature=1.0, seed=s),
            request_id=f"c{s}",
        )
        for s in range(8)
    ]
    outs = small.generate(crowd)
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    alone = small.generate(
        [
            small.make_request(
                msgs(long_text(50, seed=3)),
                schema_params(PERSON, temperature=1.0, seed=3),
                request_id="x",
            )
        ]
    )
    assert alone[0].outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_regex_choice_and_json_object(llm):
    regex = StructuredOutputSpec("regex", r"(yes|no): [0-9]{2,4}!")
    obj = StructuredOutputSpec("json_object")
    outs = llm.generate(
        [
            llm.make_request(
                msgs(),
                SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_output=regex),
                request_id=f"re{s}",
            )
            for s in range(4)
        ]
        + [
            llm.make_request(
                msgs(),
                SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_output=obj),
                request_id="obj",
            )
        ]
    )
    for o in outs[:4]:
        assert re.fullmatch(r"(yes|no): [0-9]{2,4}!", o.outputs[0].text), o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop"
    text = outs[4].outputs[0].text
    assert text.startswith("{")  # random weights: the object may not close within 40 tokens
    if outs[4].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "if": {"type": "string"}, "then": {}}, "Unimplemented"),
        ({"type": "yaml"}, "yaml"),
        ({"type": "string", "pattern": "[a-z"}, "regex"),
        ({"properties": {"a": {"$ref": "#/defs/missing"}}}, "missing"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ],
)
def test_what_cannot_be_enforced_is_refused(llm, schema, words):
    with pytest.raises(StructuredOutputError, match=words):
        llm.generate([llm.make_request(msgs(), schema_params(schema), request_id="bad")])
    assert_clean(llm)


def test_bounds_and_cache():
    with pytest.raises(ValueError, match="at most"):
        StructuredOutputSpec("regex", "a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(ValueError, match="kind"):
        StructuredOutputSpec("yaml", "x")
    with pytest.raises(ValueError, match="JSON object"):
        StructuredOutputSpec.json_schema("[1, 2]")


def test_a_schema_is_compiled_once(llm):
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["a", "b"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    compiler = llm.engine.core.structured.compiler
    before = compiler.num_compiled
    reqs = [
        llm.make_request(msgs(), schema_params(schema, temperature=1.0, seed=s), request_id=f"k{s}")
        for s in range(3)
    ]
    outs = llm.generate(reqs)
    outs += llm.generate(
        [llm.make_request(msgs(), schema_params(schema, temperature=0), request_id="k9")]
    )
    assert compiler.num_compiled == before + 1
    for o in outs:
        assert json.loads(o.outputs[0].text)["k"] in ("a", "b")


def test_apply_token_bitmasks_touches_only_constrained_rows():
    logits = torch.zeros(3, 20)
    allow_3_and_17 = bytes([0b00001000, 0, 0b00000010, 0])
    empty = bytes(4)
    failed = apply_token_bitmasks(logits, [0, 2], [allow_3_and_17, empty])
    assert failed == [2]
    assert torch.isinf(logits[0]).sum() == 18 and logits[0, 3] == 0 and logits[0, 17] == 0
    assert not torch.isinf(logits[1]).any() and not torch.isinf(logits[2]).any()
