"""The engine applies LoRA to exactly the targets adapter validation reads off the config.

For each architecture the transformers backend serves, the model's ``lora_targets()`` (what the
engine wraps in ``LoRALinear``) and :func:`adapters.base_model.model_targets` of the config
alone (what the gateway validates uploads with) give the same ``(layer, name) -> shape``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from loraplex.adapters.base_model import model_targets
from loraplex.engine.lora.layers import target_shapes
from loraplex.engine.lora.targets import served_targets
from loraplex.engine.models.transformers_backend.model import TransformersForCausalLM

TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
PHI3 = ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")
CONFIGS = {
    "phi3": (lambda: transformers.Phi3Config(**TEXT), PHI3),
    "qwen3": (lambda: transformers.Qwen3Config(**TEXT, head_dim=8), LLAMA),
    "gemma2": (lambda: transformers.Gemma2Config(**TEXT, head_dim=8), LLAMA),
    "granite": (lambda: transformers.GraniteConfig(**TEXT), LLAMA),
    "olmo2": (lambda: transformers.Olmo2Config(**TEXT), LLAMA),
    # transformers 5 fuses the experts into 3-D parameters: only attention is nn.Linear
    "mixtral": (lambda: transformers.MixtralConfig(**TEXT, num_local_experts=4), ATTENTION),
    # layer 0 a dense MLP, layer 1 experts: two kinds of layer
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeConfig(
            **TEXT, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[0],
        ),
        LLAMA,
    ),
    "gemma3": (
        lambda: transformers.Gemma3Config(
            text_config=dict(**TEXT, head_dim=8),
            vision_config=dict(
                hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                image_size=28, patch_size=14,
            ),
            mm_tokens_per_image=4,
        ),
        LLAMA,
    ),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_backend_targets_are_what_validation_reads_off_the_config(arch):
    make_config, names = CONFIGS[arch]
    config = make_config()
    auto = AutoModelForImageTextToText if arch == "gemma3" else AutoModelForCausalLM
    torch.manual_seed(0)
    model = TransformersForCausalLM(auto.from_config(make_config()).eval())
    from_config = model_targets(config)
    assert from_config.shapes() == target_shapes(model)
    assert served_targets(model, config) == from_config
    assert from_config.names == names
    assert len(from_config.kinds) == (2 if arch == "qwen3_moe" else 1)
    for layer, name, linear in model.lora_targets():
        path = next(t.path for t in from_config.layer(layer) if t.name == name)
        assert model.lora_module_name(layer, name) == f"{from_config.layers_prefix}.{layer}.{path}"
        assert isinstance(linear, torch.nn.Linear)


def test_a_model_whose_targets_differ_from_its_config_is_refused(tiny_text_dir):
    """The native Llama against a wider config: the engine would not start."""
    from loraplex.engine.models import load_model

    model, config = load_model(tiny_text_dir, torch.float32, "cpu", "native")
    assert served_targets(model, config).shapes() == target_shapes(model)
    config.intermediate_size += 8
    with pytest.raises(ValueError, match="LoRA targets differ .* other shapes .*gate_proj"):
        served_targets(model, config)
