"""``--model-impl``: which implementation serves a config, and what each refuses."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.models.registry import resolve_model_impl

SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def _llama(**extra):
    from transformers import LlamaConfig

    config = LlamaConfig(**SMALL, **extra)
    config.architectures = ["LlamaForCausalLM"]
    return config


def test_auto_takes_the_native_model_where_one_exists():
    assert resolve_model_impl(_llama()) == "native"
    assert resolve_model_impl(_llama(), "native") == "native"
    assert resolve_model_impl(_llama(), "transformers") == "transformers"


def test_auto_falls_back_to_transformers_when_the_native_model_refuses_the_config():
    config = _llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert resolve_model_impl(config) == "transformers"
    with pytest.raises(ValueError, match="native LlamaForCausalLM refuses this config.*dynamic"):
        resolve_model_impl(config, "native")


def test_architectures_without_native_code_take_the_transformers_backend():
    from transformers import Gemma2Config, Qwen3Config

    assert resolve_model_impl(Qwen3Config(**SMALL)) == "transformers"
    assert resolve_model_impl(Gemma2Config(**SMALL)) == "transformers"
    with pytest.raises(ValueError, match="no native model for 'model_type=qwen3'.*--model-impl"):
        resolve_model_impl(Qwen3Config(**SMALL), "native")


@pytest.mark.parametrize(
    ("config_class", "why"),
    [
        ("Qwen3NextConfig", r"layer types \['linear_attention'\] are not supported"),
        ("Gemma3nTextConfig", "K/V shared between layers"),
        ("T5Config", "no causal-LM model for model_type 't5'"),
    ],
)
def test_what_the_paged_cache_cannot_hold_is_refused_by_name(config_class, why):
    import transformers

    config = getattr(transformers, config_class)()
    with pytest.raises(ValueError, match=why):
        resolve_model_impl(config)


def test_an_architecture_that_is_not_its_model_types_is_refused():
    from transformers import Qwen3Config

    config = Qwen3Config(**SMALL)
    config.architectures = ["Qwen3ForSequenceClassification"]
    with pytest.raises(ValueError, match="not the causal-LM model of model_type 'qwen3'"):
        resolve_model_impl(config, "transformers")


def test_unknown_impl():
    with pytest.raises(ValueError, match="unknown model_impl"):
        resolve_model_impl(_llama(), "vllm")


def test_the_paged_attention_runs_only_inside_a_step():
    from loraplex.engine.models.transformers_backend import paged_attention_forward

    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(RuntimeError, match="only inside an engine step"):
        paged_attention_forward(torch.nn.Module(), q, q, q, None)
