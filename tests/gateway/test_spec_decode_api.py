"""Speculative decoding behind the API (issue 17): the openai SDK gets the same completions
from a speculating engine process as from a plain engine, and ``/metrics`` counts proposals."""

import re

import pytest

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.server.build import start_engine
from tests.gateway.live import NO_LIMITS, LiveGateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_engine(tiny_text_dir, tmp_path_factory):
    config = EngineConfig(
        model=str(tiny_text_dir),
        served_model_name="tiny",
        num_kv_blocks=128,
        speculative_method="ngram",
        num_speculative_tokens=4,
        prompt_lookup_min=1,
    )
    client = start_engine(config, tmp_path_factory.mktemp("store"), in_process=False)
    yield client
    client.shutdown()


def test_completions_match_plain_decoding_and_metrics_count_proposals(
    spec_engine, tiny_text_dir, tmp_path
):
    plain = LLM(EngineConfig(model=str(tiny_text_dir), num_kv_blocks=128))
    prompts = ["hello hello hello", "a river, a river, a bridge"]
    with LiveGateway(spec_engine, tmp_path / "data", **NO_LIMITS) as gw:
        sdk = gw.openai(gw.create_tenant("acme")["api_key"])
        for i, prompt in enumerate(prompts):
            messages = [{"role": "user", "content": prompt}]
            kwargs = {"temperature": 0.0} if i == 0 else {"temperature": 0.8, "seed": 11}
            got = sdk.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=60,
                logprobs=True,
                extra_body={"ignore_eos": True},
                **kwargs,
            )
            params = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=0, **kwargs)
            want = plain.generate([plain.make_request(messages, params)])[0].outputs[0]
            assert got.choices[0].message.content == want.text
            assert got.usage.completion_tokens == 60 == len(got.choices[0].logprobs.content)
        text = gw.metrics()
    counts = {
        name: float(value)
        for name, value in re.findall(r"^loraplex_(spec_decode_\w+?)_total (\S+)$", text, re.M)
    }
    assert counts["spec_decode_num_draft_tokens"] >= counts["spec_decode_num_accepted_tokens"] > 0
    assert counts["spec_decode_num_drafts"] > 0
    assert 'loraplex_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


def test_serve_flags_reach_the_engine_config():
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.engine_args import config_from_args

    args = build_parser().parse_args(
        ["serve", "--speculative-method", "draft", "--num-speculative-tokens", "3",
         "--speculative-model", "/models/draft"]
    )  # fmt: skip
    config = config_from_args(args, "m")
    assert (config.speculative_method, config.spec_k, config.speculative_model) == (
        "draft",
        3,
        "/models/draft",
    )
    assert config_from_args(build_parser().parse_args(["serve"]), "m").spec_k == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-method", "medusa"])
    with pytest.raises(ValueError, match="speculative_model"):
        config_from_args(build_parser().parse_args(["serve", "--speculative-method", "draft"]), "m")
