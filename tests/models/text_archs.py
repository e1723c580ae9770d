"""Tiny random checkpoints of today's text architectures, built from their real config classes.

Each entry of :data:`ARCHS` names a transformers config class and the fields that make the
architecture what it is (GQA, rope scaling, sliding windows, tied embeddings, q/k norms,
soft-capping, Granite's multipliers, MoE routing), on a common tiny shape (hidden 64, 2 layers,
4 query heads over 2 KV heads of 16, vocabulary 512). :func:`build_checkpoint` draws random
weights and saves the model with a tokenizer the engine can load; :func:`make_adapter` makes a
LoRA adapter with peft itself and randomizes it; :func:`hf_greedy` is the oracle, transformers'
``generate`` (float32, greedy, eager attention) on the same checkpoint.

Values are chosen so each field matters in a 2-layer model: the sliding windows (8) are far
shorter than the prompts (50-110 tokens), the soft caps are small enough that ``tanh`` bends the
scores, rope scaling's original length (64-128) is inside the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.models.tiny_model import BOS_ID, EOS_ID, PAD_ID

VOCAB = 512
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA everywhere
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
WINDOW = 8


@dataclass(frozen=True)
class Arch:
    """One architecture's tiny checkpoint recipe.

    Attributes:
        config_class: The transformers config class name.
        fields: Config fields over :data:`COMMON`.
        lora_targets: The ``target_modules`` of its test adapter.
        embed_std: Std of the embedding weights (the other matrices: 0.3).
        norm_shift: Added to the decoder layers' norm weights. Gemma scales its tied embeddings
            by ``sqrt(hidden)`` and post-norms every sublayer's output, so with plain norms the
            input token's own embedding dominates the residual and greedy decoding repeats it;
            smaller embeddings and larger layer norms make every layer matter.
        exclude: Keys of :data:`COMMON` the config class does not take under that name.
    """

    config_class: str
    fields: dict[str, Any] = field(default_factory=dict)
    lora_targets: tuple[str, ...] = LLAMA_TARGETS
    embed_std: float = 0.3
    norm_shift: float = 0.0
    exclude: tuple[str, ...] = ()

    def config(self, **overrides: Any) -> Any:
        """The transformers config: :data:`COMMON`, then :attr:`fields`, then ``overrides``."""
        import transformers

        common = {k: v for k, v in COMMON.items() if k not in self.exclude}
        return getattr(transformers, self.config_class)(**{**common, **self.fields, **overrides})


ARCHS: dict[str, Arch] = {
    # The engine's native architecture, for the native-vs-transformers comparison: tied
    # embeddings, llama3 rope scaling over 64 original positions.
    "llama": Arch(
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        },
    ),
    # q/k RMSNorm per head; yarn rope scaling (factor 4 over 128 original positions).
    "qwen3": Arch(
        "Qwen3Config",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
            }
        },
    ),
    # Alternating sliding/full layers, attention and final logit soft-capping, a query scale
    # that is not head_dim's, tied embeddings scaled by sqrt(hidden), pre and post norms.
    "gemma2": Arch(
        "Gemma2Config",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 5.0,
        },
        embed_std=0.1,
        norm_shift=1.0,
    ),
    # Gemma 2's layout with q/k norms, no soft-capping, and a rope per layer type: local
    # layers theta 1e4, global ones theta 1e6 with linear scaling (factor 8, as Gemma 3 4B+).
    "gemma3_text": Arch(
        "Gemma3TextConfig",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        },
        embed_std=0.1,
        norm_shift=1.0,
    ),
    # Fused qkv_proj and gate_up_proj, a sliding window on every layer, partial rotary.
    "phi3": Arch(
        "Phi3Config",
        {
            "sliding_window": WINDOW,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
        lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    ),
    # Phi-3 128k / Phi-3.5 / Phi-4-mini's longrope: short factors up to 64 positions (the
    # original length here), long ones past it.
    "phi3_longrope": Arch(
        "Phi3Config",
        {
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 4.0, 8.0, 16.0],
                "original_max_position_embeddings": 64,
            },
        },
        lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    ),
    # Embedding, residual and attention multipliers, logits divided by logits_scaling; llama3
    # rope scaling over 64 original positions.
    "granite": Arch(
        "GraniteConfig",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.1,
            "logits_scaling": 4.0,
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        },
    ),
    # q/k RMSNorm over the whole projection (not per head), norms after each sublayer.
    "olmo2": Arch("Olmo2Config"),
    # Pythia's GPT-NeoX: fused query_key_value, rotary on a quarter of each head, parallel
    # residual; its config has no num_key_value_heads (every head has its K/V).
    "gpt_neox": Arch(
        "GPTNeoXConfig",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.25,
            }
        },
        lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
        exclude=("num_key_value_heads", "head_dim"),
    ),
    # StarCoder's GPT-BigCode: multi-query attention (one K/V head), learned absolute positions.
    "gpt_bigcode": Arch(
        "GPTBigCodeConfig",
        {"multi_query": True, "n_inner": 96},
        lora_targets=("c_attn", "c_proj", "c_fc"),
        exclude=("num_key_value_heads", "head_dim", "intermediate_size"),
    ),
    # gpt-oss: attention sinks (s_aux), alternating sliding/full layers, yarn rope, attention
    # biases, 4 experts top-2 (its default layer_types alternate sliding and full).
    "gpt_oss": Arch(
        "GptOssConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
                "rope_theta": 150000.0,
            },
        },
        lora_targets=ATTENTION_TARGETS,
    ),
    # BLOOM: ALiBi biases its own attention outside AttentionInterface; the backend refuses it.
    "bloom": Arch("BloomConfig", lora_targets=()),
    # 4 experts, top-2 routing, a sliding window on every layer.
    "mixtral": Arch(
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
        lora_targets=ATTENTION_TARGETS,
    ),
    # 6 experts, top-2 with renormalized weights; layer 1 dense (mlp_only_layers).
    "qwen3_moe": Arch(
        "Qwen3MoeConfig",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
        lora_targets=ATTENTION_TARGETS,
    ),
}


def randomize_(model: torch.nn.Module, arch: Arch, seed: int) -> torch.nn.Module:
    """Draw every weight: matrices (and stacked experts) N(0, 0.3), embeddings N(0, embed_std),
    vectors (norms, biases) their initial value + N(0, 0.1) (+ ``norm_shift`` on layer norms).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "embed" in name:
                p.copy_(noise * arch.embed_std)
            elif p.dim() > 1:
                p.copy_(noise * 0.3)
            else:
                shift = arch.norm_shift if "norm" in name and ".layers." in name else 0.0
                p.add_(noise * 0.1 + shift)
    return model


def build_checkpoint(name: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random ``name`` checkpoint (float32 safetensors) and a tokenizer to ``directory``.

    Args:
        name: A key of :data:`ARCHS`.
        directory: Where to write (created).
        seed: Seed of the weights.
        overrides: Config fields over the recipe's (e.g. ``num_hidden_layers=1`` for a draft).

    Returns:
        ``directory``.
    """
    from transformers import AutoModelForCausalLM

    from loraplex.engine.models.tiny_model import _save_tokenizer_and_processor

    arch = ARCHS[name]
    config = arch.config(**overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, arch, seed).save_pretrained(directory, safe_serialization=True)
    _save_tokenizer_and_processor(Path(directory), VOCAB, COMMON["max_position_embeddings"], True)
    return Path(directory)


def load_hf(model_dir: Path) -> torch.nn.Module:
    """transformers' own model of a checkpoint: float32, eager attention, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def make_adapter(
    model_dir: Path, targets: tuple[str, ...], out: Path, seed: int = 1, rank: int = 4
) -> torch.nn.Module:
    """A LoRA adapter made with peft's ``get_peft_model`` on the checkpoint, saved to ``out``.

    peft initialises B to zero; every LoRA weight is redrawn N(0, 0.3) so the delta matters.

    Returns:
        The peft model itself (eval), the adapter's oracle.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    peft_model = get_peft_model(load_hf(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out, safe_serialization=True)
    return peft_model.eval()


def hf_greedy(model: torch.nn.Module, tokenizer: Any, text: str, max_tokens: int):
    """transformers ``generate`` (greedy) on one user message through the chat template.

    Returns:
        ``(prompt token ids, generated token ids, their logprobs)``: generation stops at EOS as
        the engine's does; the logprobs are ``log_softmax`` of the model's own logits (after its
        logit scaling and soft-capping), which greedy tokens alone cannot check.
    """
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item()
        for step, t in zip(out.logits, tokens, strict=True)
    ]
    return prompt, tokens, logprobs
