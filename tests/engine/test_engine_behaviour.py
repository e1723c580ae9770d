"""Engine behaviour beyond greedy parity: seeds, n > 1, abort, stops, bad input, streaming, CLI."""

import asyncio
import json
import re
import shutil

import pytest

from loraplex.engine.client.front import AsyncLLM
from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.cli import main as cli_main

from .conftest import long_text, photo, user


@pytest.fixture(scope="module")
def llm(tiny_llava_dir, make_llm):
    return make_llm(model=tiny_llava_dir, num_kv_blocks=256)


def assert_clean(llm):
    assert llm.engine.kv.pool.num_used == 0
    assert not llm.engine.requests
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_seeded_sampling_is_the_same_whatever_the_batch(llm):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234)
    target = user("tell me a story about", photo("chelsea"))
    alone = llm.generate([llm.make_request(target, sampling, request_id="alone")])[0]
    others = [
        llm.make_request(
            user(long_text(40 + 10 * i, seed=i)),
            SamplingParams(temperature=1.0, max_tokens=9),
            request_id=f"o{i}",
        )
        for i in range(4)
    ]
    mixed = others[:2] + [llm.make_request(target, sampling, request_id="mixed")] + others[2:]
    outs = llm.generate(mixed)
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = llm.generate(
        [
            llm.make_request(target, SamplingParams(temperature=1.0, max_tokens=12), request_id=u)
            for u in ("u1", "u2")
        ]
    )
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids
    assert_clean(llm)


def test_n_greater_than_one_shares_the_prompt_blocks(llm):
    engine = llm.engine
    n = 4
    req = llm.make_request(
        user(long_text(150, seed=9)),
        SamplingParams(n=n, temperature=1.0, max_tokens=6, seed=5),
        request_id="fork",
    )
    prompt_blocks = -(-len(req.prompt_token_ids) // engine.kv.block_size)
    engine.add_request(req)
    while not engine.requests["fork"].forked:
        engine.step()
    # Measured in the pool: every prompt block is held by all n sequences, not copied n times.
    tables = [engine.kv.get_block_ids(s.seq_id) for s in engine.requests["fork"].seqs]
    assert len(tables) == n
    assert all(t == tables[0] for t in tables)
    assert engine.kv.pool.num_used == prompt_blocks
    assert all(engine.kv.pool.blocks[b].ref_cnt == n for b in tables[0])
    engine.step()  # each sequence writes its first token: the partial last block is copied
    used_after = engine.kv.pool.num_used
    assert used_after <= prompt_blocks + n
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.finished and len(final.outputs) == n
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1
    assert_clean(llm)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_request(
            llm.make_request(
                user(long_text(80, seed=i)),
                SamplingParams(temperature=0, max_tokens=30),
                request_id=f"ab{i}",
            )
        )
    engine.step()
    engine.step()
    held = engine.kv.num_blocks_of("ab1")
    before = engine.kv.pool.num_used
    out = engine.abort_request("ab1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.pool.num_used == before - held
    assert engine.abort_request("ab1") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(llm)


def test_stop_reasons(llm):
    base = llm.generate(
        [llm.make_request(user("count with me"), SamplingParams(temperature=0, max_tokens=12))]
    )[0]
    text = base.outputs[0].text
    assert base.outputs[0].finish_reason in ("length", "stop")
    if base.outputs[0].finish_reason == "length":
        assert len(base.outputs[0].token_ids) == 12
    cut = text[len(text) // 2 : len(text) // 2 + 3]
    if cut.strip():
        stopped = llm.generate(
            [
                llm.make_request(
                    user("count with me"), SamplingParams(temperature=0, max_tokens=12, stop=[cut])
                )
            ]
        )[0]
        assert stopped.outputs[0].finish_reason == "stop"
        assert stopped.outputs[0].text == text[: text.index(cut)]
    by_id = llm.generate(
        [
            llm.make_request(
                user("count with me"),
                SamplingParams(
                    temperature=0, max_tokens=12, stop_token_ids=[base.outputs[0].token_ids[1]]
                ),
            )
        ]
    )[0]
    assert by_id.outputs[0].token_ids == base.outputs[0].token_ids[:2]
    assert by_id.outputs[0].finish_reason == "stop"
    assert_clean(llm)


def test_bad_input_is_refused_and_nothing_leaks(llm, tiny_llava_dir, tmp_path):
    engine = llm.engine
    too_long = EngineRequest("long", [5] * engine.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="prompt is .* tokens"):
        engine.add_request(too_long)
    good = llm.make_request(user("look", photo("astronaut")), SamplingParams(), request_id="g")
    extra = EngineRequest("extra", good.prompt_token_ids, SamplingParams(), images=good.images * 2)
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request(extra)
    missing = EngineRequest("missing", good.prompt_token_ids, SamplingParams(), images=[])
    with pytest.raises(ValueError, match="more images than placeholders or the reverse"):
        engine.add_request(missing)
    with pytest.raises(ValueError, match="image_url must be a data: URL"):
        llm.make_request(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
                    ],
                }
            ],
            SamplingParams(),
        )
    with pytest.raises(ValueError):
        llm.make_request(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                    ],
                }
            ],
            SamplingParams(),
        )
    with pytest.raises(ValueError, match="messages"):
        llm.make_request([], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request(EngineRequest("bad-params", [1, 2, 3], SamplingParams(max_tokens=-1)))
    assert_clean(llm)
    out = llm.generate([good])[0]  # the engine still serves
    assert out.finished and out.outputs[0].token_ids


def test_unreadable_or_unsupported_model_directory(tiny_text_dir, tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="nowhere"):
        LLM(EngineConfig(model=str(tmp_path / "nowhere")))
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_text_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel|gpt2"):
        LLM(EngineConfig(model=str(bad)))


def test_async_streaming_and_disconnect(tiny_llava_dir, llm):
    async_llm = AsyncLLM.in_process(engine=llm.engine)

    async def scenario():
        req = llm.make_request(
            user("stream this"), SamplingParams(temperature=0, max_tokens=10), request_id="s1"
        )
        deltas, tokens, last = [], [], None
        async for out in async_llm.generate(req):  # DELTA outputs: only what is new
            deltas.append(out.outputs[0].text)
            tokens.extend(out.outputs[0].token_ids)
            last = out
        assert last.finished and last.outputs[0].num_tokens == len(tokens)
        if last.outputs[0].finish_reason == "stop":
            tokens = tokens[:-1]  # EOS: its text is left out
        assert "".join(deltas) == llm.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        # A client that goes away mid-stream: the request is aborted, its blocks freed.
        req2 = llm.make_request(
            user(long_text(50)), SamplingParams(temperature=0, max_tokens=50), request_id="s2"
        )
        async for out in async_llm.generate(req2):
            if out.outputs[0].token_ids:
                break
        for _ in range(100):
            if not llm.engine.requests:
                break
            await asyncio.sleep(0.02)
        # A refused request raises in the consumer; the engine goes on.
        with pytest.raises(ValueError):
            bad = EngineRequest("s3", [1] * llm.engine.max_model_len, SamplingParams())
            async for _ in async_llm.generate(bad):
                pass

    try:
        asyncio.run(scenario())
    finally:
        async_llm.shutdown()
    assert_clean(llm)


def test_generate_cli(tiny_llava_dir, tmp_path):
    from .conftest import data_url

    lines = [
        {"messages": user("hello there"), "max_tokens": 5, "temperature": 0},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is it?"},
                        {"type": "image_url", "image_url": {"url": data_url(photo("coffee"))}},
                    ],
                }
            ],
            "max_tokens": 4,
            "temperature": 0,
            "n": 2,
            "seed": 3,
        },
        {"messages": "not a list"},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    outp = tmp_path / "out.jsonl"
    status = cli_main(
        ["generate", "--model", tiny_llava_dir, "--input", str(inp), "--output", str(outp)]
    )
    results = [json.loads(x) for x in outp.read_text().splitlines()]
    assert status == 1  # the third line is invalid
    assert [r["index"] for r in results] == [0, 1, 2]
    assert len(results[0]["outputs"]) == 1 and len(results[1]["outputs"]) == 2
    assert results[0]["outputs"][0]["finish_reason"] in ("length", "stop")
    assert results[0]["prompt_token_ids"] and results[0]["cached_tokens"] == 0
    assert "error" in results[2] and "messages" in results[2]["error"]["message"]


def test_vision_cache_is_scoped_by_salt(llm):
    engine = llm.engine
    img = photo("rocket")
    sampling = SamplingParams(temperature=0, max_tokens=2)
    before = engine.runner.num_images_encoded
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        llm.generate([llm.make_request(user("what?", img), sampling, cache_salt=salt)])
    # Encoded once for tenant-a (the second request reuses it), once again for tenant-b.
    assert engine.runner.num_images_encoded - before == 2
    assert_clean(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_runs(tiny_text_dir, dtype):
    import torch

    llm = LLM(EngineConfig(model=tiny_text_dir, dtype=dtype, num_kv_blocks=64))
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    out = llm.generate(
        [
            llm.make_request(
                [{"role": "user", "content": long_text(30)}],
                SamplingParams(temperature=0, max_tokens=6),
            )
        ]
    )[0]
    assert len(out.outputs[0].token_ids) == 6 or out.outputs[0].finish_reason == "stop"
    assert all(0 <= t < llm.engine.model.vocab_size for t in out.outputs[0].token_ids)


def test_default_model_is_created_in_the_data_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": user("hi"), "max_tokens": 3, "temperature": 0}) + "\n")
    status = cli_main(["generate", "--input", str(inp), "--output", str(tmp_path / "o.jsonl")])
    assert status == 0
    assert (tmp_path / "data" / "models" / "tiny-llava" / "config.json").exists()
    assert json.loads((tmp_path / "o.jsonl").read_text())["outputs"][0]["token_ids"]
    # No sizing flag: the pool's size and how it was decided are printed (docs/kv_sizing.md).
    assert re.search(
        r"loraplex: KV pool of \d+ blocks \(16 tokens each, \d+ tokens\) = [\d.]+ GiB "
        r"\(--cpu-kv-cache-share 0.5 of [\d.]+ GiB RAM available",
        capsys.readouterr().err,
    )


def test_init_tiny_cli(tmp_path, capsys):
    status = cli_main(["model", "init-tiny", str(tmp_path / "m"), "--seed", "3", "--text-only"])
    assert status == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["text_only"] is True
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(tmp_path / "nowhere"),
                "--input",
                str(tmp_path / "none.jsonl"),
                "--output",
                str(tmp_path / "x"),
            ]
        )
        == 1
    )
