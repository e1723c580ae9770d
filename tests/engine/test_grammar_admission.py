"""A request waits for its grammar off the step (issue 27 item 1; vLLM's WAITING_FOR_FSM): the
engine keeps decoding everyone else while a spec is vetted and compiled, a spec the sandbox
refuses (a native crash included) fails its own request with ``StructuredOutputError`` after
admission, and the engine runs on."""

import asyncio
import re
from concurrent.futures import Future

import pytest

from loraplex.engine.client.front import AsyncLLM
from loraplex.engine.client.llm import LLM
from loraplex.engine.client.llm_engine import LLMEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.structured_output.grammar import StructuredOutputError, StructuredOutputSpec
from loraplex.engine.structured_output.sandbox import Verdict

from .test_grammar_sandbox import rule_chain


@pytest.fixture
def engine(tiny_text_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_text_dir), num_kv_blocks=64))
    yield eng
    eng.shutdown()


def request(rid, engine, spec=None, max_tokens=24):
    prompt = engine.tokenizer("Tell me about rivers").input_ids
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=spec)
    return EngineRequest(rid, list(prompt), params, tenant=rid)


def held_vet(engine, monkeypatch):
    """Make the sandbox's verdicts wait for the test: returns the futures it handed out."""
    handed: list[Future] = []

    def vet(kind, value, tenant=None):
        f: Future = Future()
        handed.append(f)
        return f

    monkeypatch.setattr(engine.core.structured.sandbox, "vet", vet)
    return handed


def test_decoding_goes_on_while_a_grammar_is_prepared(engine, monkeypatch):
    handed = held_vet(engine, monkeypatch)
    engine.add_request(request("free", engine, max_tokens=40))
    spec = StructuredOutputSpec("regex", "(yes|no)-[0-9]{3}")
    engine.add_request(request("json", engine, spec))
    assert engine.core.stats()["requests_waiting_for_grammar"] == 1
    free_tokens = 0
    for _ in range(10):  # ten steps while the grammar is still being vetted
        for out in engine.step():
            assert out.request_id == "free"
            free_tokens += sum(len(o.token_ids) for o in out.outputs)
    assert free_tokens >= 9
    assert "json" not in engine.core.scheduler.requests
    handed[0].set_result(Verdict(True))  # vetted: the core compiles it on its thread
    tokens, finish = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "json":
                tokens += out.outputs[0].token_ids
                finish = out.outputs[0].finish_reason
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert re.fullmatch(r"(yes|no)-[0-9]{3}", text), text
    assert finish == "stop"
    assert engine.core.stats()["requests_waiting_for_grammar"] == 0


def test_a_refused_grammar_fails_its_request_after_admission(engine, monkeypatch):
    handed = held_vet(engine, monkeypatch)
    engine.add_request(request("free", engine))
    engine.add_request(request("bad", engine, StructuredOutputSpec("regex", "a+")))
    engine.step()
    handed[0].set_result(Verdict(False, "compiling the regex crashed the grammar compiler"))
    rejected = []
    while engine.has_unfinished_requests():
        engine.step()
        rejected += engine.take_rejected()
    assert [(rid, type(e), str(e)) for rid, e in rejected] == [
        ("bad", StructuredOutputError, "compiling the regex crashed the grammar compiler")
    ]
    assert "bad" not in engine.output_processor.requests
    assert engine.kv.pool.num_used == 0


def test_an_aborted_request_leaves_while_it_waits(engine, monkeypatch):
    held_vet(engine, monkeypatch)
    engine.add_request(request("waits", engine, StructuredOutputSpec("regex", "b+")))
    assert engine.abort_request("waits") is not None
    assert not engine.has_unfinished_requests()


def test_a_grammar_that_crashes_the_compiler_fails_alone(tiny_text_dir):
    llm = LLM(EngineConfig(model=str(tiny_text_dir), num_kv_blocks=64))
    try:
        tok = llm.engine.tokenizer
        prompt = list(tok("Hello").input_ids)
        crash = SamplingParams(
            max_tokens=4, structured_output=StructuredOutputSpec("grammar", rule_chain(3000))
        )
        free = SamplingParams(temperature=0, max_tokens=6)
        with pytest.raises(StructuredOutputError, match="killed by SIGSEGV"):
            llm.generate([EngineRequest("a", prompt, free), EngineRequest("b", prompt, crash)])
        assert llm.engine.kv.pool.num_used == 0
        # the refusal is remembered: the same spec is refused at once, before anything runs
        with pytest.raises(StructuredOutputError, match="killed by SIGSEGV"):
            llm.engine.add_request(EngineRequest("c", prompt, crash))
        (out,) = llm.generate([EngineRequest("d", prompt, free)])
        assert len(out.outputs[0].token_ids) == 6
        assert llm.engine.core.stats()["grammar_worker_deaths"] == 1
    finally:
        llm.shutdown()


def test_async_clients_get_the_refusal_as_an_error(tiny_text_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_text_dir), num_kv_blocks=64))
    llm = AsyncLLM.in_process(engine=engine)
    prompt = list(engine.tokenizer("Hello").input_ids)

    async def run():
        never = SamplingParams(
            max_tokens=4, structured_output=StructuredOutputSpec.json_schema({"$ref": "#"})
        )
        with pytest.raises(StructuredOutputError, match="allows no token"):
            async for _ in llm.generate(EngineRequest("x", prompt, never)):
                pass
        outs = [o async for o in llm.generate(EngineRequest("y", prompt, SamplingParams()))]
        assert outs[-1].finished

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
        engine.shutdown()
