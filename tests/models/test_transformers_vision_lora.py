"""Per-request LoRA on transformers vision-language models, against peft's own ``generate``.

A peft adapter on the language model of a tiny Qwen2.5-VL (M-RoPE) and a tiny Gemma 3
(bidirectional image spans), made with peft itself, its weights randomized so every delta
matters; the engine runs image and text requests with and without the adapter in one batch,
prefill chunks cutting through images; each row must equal peft's (or the base model's)
greedy tokens for the same messages.
"""

from __future__ import annotations

import pytest
import torch

from tests.models import vlm_checkpoints
from tests.models.test_transformers_vision import NEW_TOKENS, SEEDS, _messages
from tests.models.test_transformers_vision import _oracle as vision_oracle

pytestmark = pytest.mark.slow

TARGETS = r".*language_model.*\.(q_proj|v_proj|o_proj|up_proj|down_proj)"
PROMPTS = (
    [0, "What is in the picture?"],
    ["the quick brown fox jumped over the lazy dogs"],
)


@pytest.fixture(scope="module")
def photos():
    from tests.media import photo

    return [photo("astronaut"), photo("chelsea")]


def _adapter(directory, out):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # peft zero-inits B: make the delta matter
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def _oracle(directory, adapter, photos):
    """Greedy tokens per ``(prompt index, with adapter)``: the base model's and peft's."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = {}
    for with_adapter in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
        if with_adapter:
            model = PeftModel.from_pretrained(model, adapter).eval()
        for i, (_, tokens) in enumerate(vision_oracle(directory, PROMPTS, photos, model)):
            out[(i, with_adapter)] = tokens
    return out


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma3"])
def test_vision_language_model_with_adapters_matches_peft(arch, tmp_path_factory, photos):
    from loraplex.engine.client.llm import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.sampling.params import SamplingParams

    directory = vlm_checkpoints.BUILDERS[arch](tmp_path_factory.mktemp(arch), SEEDS.get(arch, 0))
    adapter = _adapter(directory, tmp_path_factory.mktemp("adapter"))
    oracle = _oracle(directory, adapter, photos)
    for i in range(len(PROMPTS)):
        assert oracle[(i, False)] != oracle[(i, True)]  # the adapter changes every answer
    llm = LLM(
        EngineConfig(
            model=str(directory), model_impl="transformers", block_size=4,
            max_num_batched_tokens=32, long_prefill_token_threshold=0, max_lora_rank=8,
        )
    )  # fmt: skip
    digest = llm.engine.add_lora_dir(adapter).digest
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    keys = [(i, a) for a in (True, False) for i in range(len(PROMPTS))]
    requests = [
        llm.make_request(
            _messages(PROMPTS[i], photos, hf=False),
            sampling,
            lora_digest=digest if a else None,
            request_id=f"{arch}-{i}-{a}",
        )
        for i, a in keys
    ]
    outs = llm.generate(requests)  # adapter and base rows, image and text, one batch
    for (i, a), out in zip(keys, outs, strict=True):
        assert out.outputs[0].token_ids == oracle[(i, a)], f"prompt {i}, adapter {a}"
