"""Other Llama-family configs against transformers: Qwen2 biases, Mistral sliding window, llama3
and linear rope scaling, tied embeddings, Llama biases, LLaVA multi-layer features.

Our models run on the test device (``test_device``), transformers on the CPU; our outputs come
to the CPU for the comparison.
"""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine.models import load_model
from tests.models.harness import (
    BlockAllocator,
    Seq,
    assert_same_greedy,
    greedy_generate,
    make_kv_caches,
    randomize_,
    run_step,
)

SMALL = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def _save(tmp_path, model_cls, config, seed=0):
    model = randomize_(model_cls(config), seed).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _prompt(n, seed=0, vocab=96):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ours_logits(ours, ids, chunks=(None,), block_size=4):
    alloc, kv = BlockAllocator(64, seed=7), make_kv_caches(ours, 64, block_size)
    seq, outs, i = Seq(list(ids)), [], 0
    while seq.num_computed < len(ids):
        n = min(chunks[i % len(chunks)] or len(ids), len(ids) - seq.num_computed)
        outs += run_step(ours, kv, [(seq, n)], block_size, alloc)
        i += 1
    return ours.compute_logits(torch.cat(outs)).cpu()  # [len(ids), V] on the CPU


@torch.no_grad()
def _check(tmp_path, device, model_cls, config, n=40, chunks=(None, 7)):
    hf = _save(tmp_path, model_cls, config)
    ours, _ = load_model(tmp_path, torch.float32, device)
    ids = _prompt(n, vocab=config.vocab_size)
    ref = hf(torch.tensor([ids])).logits[0]
    for chunk in chunks:
        torch.testing.assert_close(_ours_logits(ours, ids, (chunk,)), ref, atol=1e-4, rtol=0)
    return hf, ours, ids


def test_qwen2_qkv_bias_and_mixed_sliding_layers(tmp_path, test_device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    _, ours, _ = _check(tmp_path, test_device, Qwen2ForCausalLM, config)
    attn = ours.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None  # q/k/v fused
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [None, 8]


def test_mistral_sliding_window_prefill_and_decode(tmp_path, test_device):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SMALL, sliding_window=8)
    hf, ours, ids = _check(
        tmp_path, test_device, MistralForCausalLM, config, n=30, chunks=(None, 5, 1)
    )
    # The window matters: without it the logits differ.
    for layer in ours.model.layers:
        layer.self_attn.sliding_window = None
    assert not torch.allclose(_ours_logits(ours, ids), hf(torch.tensor([ids])).logits[0], atol=1e-3)
    for layer in ours.model.layers:
        layer.self_attn.sliding_window = 8
    # Decode past the window through HF's sliding-window cache.
    mine = greedy_generate(ours, ids, max_new_tokens=12, block_size=4, chunk_sizes=(9,))
    t = torch.tensor([ids])
    ref = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=12, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    assert_same_greedy(mine, ref, lambda gen: hf(torch.tensor([ids + gen])).logits[0, -1])


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ],
)  # fmt: skip
def test_llama_rope_scaling(tmp_path, test_device, rope):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMALL, rope_parameters=rope)
    _, ours, _ = _check(tmp_path, test_device, LlamaForCausalLM, config, n=120, chunks=(None, 33))
    default = LlamaConfig(**SMALL)
    from loraplex.engine.models.config import rope_frequencies

    assert rope_frequencies(config, 8)[0] != rope_frequencies(default, 8)[0]


def test_transformers4_rope_scaling_config_is_read(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
    _save(tmp_path, LlamaForCausalLM, LlamaConfig(**SMALL, rope_parameters=rope))
    new, _ = load_model(tmp_path, torch.float32, "cpu")
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    path.write_text(json.dumps(config))
    old, _ = load_model(tmp_path, torch.float32, "cpu")
    assert old.config.rope_inv_freq == new.config.rope_inv_freq


def test_llama_tied_embeddings_and_biases(tmp_path, test_device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMALL, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    _, ours, _ = _check(tmp_path, test_device, LlamaForCausalLM, config)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.model.layers[1].self_attn.o_proj.bias is not None
    assert ours.model.layers[1].mlp.down_proj.bias is not None


@torch.no_grad()
@pytest.mark.parametrize("feature_layer,strategy", [([-3, -1], "full"), (-1, "default")])
def test_llava_feature_layers_and_strategy(tmp_path, test_device, feature_layer, strategy):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=16, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=2)  # fmt: skip
    config = LlavaConfig(
        text_config=LlamaConfig(**SMALL),
        vision_config=vision,
        image_token_id=95,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
    )
    hf = _save(tmp_path, LlavaForConditionalGeneration, config)
    ours, _ = load_model(tmp_path, torch.float32, test_device)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))  # CPU
    tokens = 5 if strategy == "full" else 4
    assert ours.num_image_tokens == tokens
    ref = torch.stack(list(hf.model.get_image_features(pixel_values=pixels).pooler_output))
    features = ours.encode_images(pixels.to(ours.device))
    torch.testing.assert_close(features.cpu(), ref, atol=1e-5, rtol=0)
    ids = _prompt(6) + [95] * tokens + _prompt(5, seed=1) + [95] * tokens + [7]
    ref_logits = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    ids_t = torch.tensor(ids, device=ours.device)
    embeds = ours.embed_tokens(ids_t)
    embeds[ids_t == 95] = features.reshape(-1, 32)
    alloc, kv = BlockAllocator(32), make_kv_caches(ours, 32, 4)
    (hidden,) = run_step(ours, kv, [(Seq(ids, embeds), len(ids))], 4, alloc)
    torch.testing.assert_close(ours.compute_logits(hidden).cpu(), ref_logits, atol=1e-4, rtol=0)
