"""Any transformers causal LM over the engine's paged KV cache: the model's own code, our KV.

:class:`TransformersForCausalLM` wraps a model built by ``AutoModelForCausalLM`` (or the text
decoder of an ``AutoModelForImageTextToText`` one) whose decoder attention is the engine's paged
attention (:mod:`.attention`). It offers the step interface of the native models
(``engine.models``): one forward over the step's flattened tokens as a batch of one row,
``position_ids`` the tokens' positions in their own sequences, no transformers cache, and the
hidden states' rows fed to :meth:`compute_logits`. Every other operation (embeddings and their
scaling, q/k norms, rotary embeddings of any kind, MLPs, MoE routing, final norm, logit scaling
and soft-capping) is the transformers model's own, so a new architecture needs no code here.

Design after vLLM's Transformers backend (``--model-impl transformers``); see
docs/transformers_backend.md for what it supports and what it refuses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from loraplex.adapters.base_model import find_decoder_layers, lora_target_names
from loraplex.engine.attention import AttentionBackend, AttentionMetadata
from loraplex.engine.models.transformers_backend.attention import (
    ATTN_IMPLEMENTATION,
    PagedAttentionBypassed,
    PagedStep,
    paged_step,
)
from loraplex.engine.models.transformers_backend.probe import measure_attention_shapes
from loraplex.engine.models.transformers_backend.rotary import wrap_length_dependent_rotary

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _attention_of(layer: nn.Module, index: int) -> nn.Module:
    """The one self-attention module of a decoder layer, which must be causal.

    Raises:
        ValueError: none or several, or a module that is not causal (``is_causal`` False).
    """
    found = [
        m
        for m in layer.modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
    ]
    if len(found) != 1:
        raise ValueError(
            f"decoder layer {index} ({type(layer).__name__}) has {len(found)} attention modules "
            "with a layer index; the transformers backend needs exactly one"
        )
    if getattr(found[0], "is_causal", True) is False:
        raise ValueError(
            f"decoder layer {index}'s attention is bidirectional (is_causal False): the paged "
            "attention is causal"
        )
    return found[0]


def check_text_config(text_config: Any) -> None:
    """Refuse what the paged KV cache cannot hold: non-attention layers, shared or mixed K/V.

    Raises:
        ValueError: a hybrid (state-space, linear or chunked attention) layer type, K/V shared
            between layers, multi-head latent attention, or bidirectional attention over the
            whole sequence (an embedding model's ``use_bidirectional_attention``).
    """
    layer_types = getattr(text_config, "layer_types", None) or []
    odd = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if odd:
        raise ValueError(
            f"layer types {odd} are not supported: the paged KV cache holds full and "
            "sliding-window attention layers only"
        )
    if getattr(text_config, "num_kv_shared_layers", 0):
        raise ValueError("K/V shared between layers (num_kv_shared_layers) is not supported")
    if getattr(text_config, "kv_lora_rank", None):
        raise ValueError("multi-head latent attention (kv_lora_rank) is not supported")
    if getattr(text_config, "use_bidirectional_attention", None) in (True, "all"):
        raise ValueError(
            "bidirectional attention (use_bidirectional_attention) is not supported: the paged "
            "attention is causal"
        )


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM run by the engine (see the module docstring).

    Args:
        hf_model: A ``PreTrainedModel`` with an LM head whose text decoder's attention
            implementation is ``"loraplex"`` (:func:`.loader.load_transformers_model`).

    Raises:
        ValueError: a decoder the paged cache cannot serve (:func:`check_text_config`), or
            whose layers or attention modules cannot be found.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.hf_config = hf_model.config
        self.text_config = self.hf_config.get_text_config()
        check_text_config(self.text_config)
        self.decoder = hf_model.get_decoder()
        wrap_length_dependent_rotary(self.decoder)  # longrope, dynamic NTK: per sequence
        num_layers = int(self.text_config.num_hidden_layers)
        self.layers = find_decoder_layers(self.decoder, num_layers)
        self._attention_modules = [_attention_of(layer, i) for i, layer in enumerate(self.layers)]
        self._layer_of = {id(m): i for i, m in enumerate(self._attention_modules)}
        self.lm_head = hf_model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(hf_model).__name__} has no output embeddings (LM head)")
        cfg = self.text_config
        # As the attention layers pass them, not as the config names them (:mod:`.probe`).
        self._num_heads, self._num_kv_heads, self._head_dim = measure_attention_shapes(self)
        positions = [getattr(cfg, f, None) for f in _POSITION_FIELDS]
        if not any(positions):
            raise ValueError("the config gives no maximum length (max_position_embeddings)")
        self._max_positions = int(next(p for p in positions if p))
        paths = {}
        for i, layer in enumerate(self.layers):
            linears = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
            paths[i] = lora_target_names(linears)
        self._target_paths = paths  # layer -> {path in layer: engine name}
        self._layer_prefix = next(name for name, m in hf_model.named_modules() if m is self.layers)

    # Properties the model runner sizes the KV pool and the batch with.
    @property
    def num_layers(self) -> int:
        """Decoder layers (one ``(k_cache, v_cache)`` pair each)."""
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        """Query heads."""
        return self._num_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        """Per-head size."""
        return self._head_dim

    @property
    def hidden_size(self) -> int:
        """Model width."""
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""
        return int(self.lm_head.weight.shape[0])

    @property
    def attention_soft_cap(self) -> float | None:
        """The attention logit soft cap the model's layers pass (``attn_logit_softcapping``).

        The attention backend must apply it (``engine.attention.check_backend_runs``).
        """
        cap = getattr(self.text_config, "attn_logit_softcapping", None)
        return float(cap) if cap is not None else None

    @property
    def attention_sinks(self) -> bool:
        """Whether the decoder's attention layers have sinks.

        gpt-oss's ``sinks``, passed to the attention function as ``s_aux``; the attention
        backend must apply them (``engine.attention.check_backend_runs``).
        """
        return any(
            isinstance(getattr(m, "sinks", None), torch.Tensor) for m in self._attention_modules
        )

    @property
    def max_position_embeddings(self) -> int:
        """The model's longest context."""
        return self._max_positions

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights and activations."""
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.lm_head.weight.device

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the model's input embedding computes them: ``[T] -> [T, hidden]``.

        (Gemma's scaled embeddings scale here, as in transformers.)
        """
        return self.hf.get_input_embeddings()(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        inputs_embeds: torch.Tensor | None = None,
        **decoder_kwargs: Any,
    ) -> torch.Tensor:
        """Run one step; the arguments and result are the native models' (``LlamaForCausalLM``).

        Args:
            input_ids: ``[T]`` int64 token ids (ignored when ``inputs_embeds`` is given).
            positions: ``[T]`` int64 position of each token in its sequence, or ``[3, T]`` for
                a model with multimodal rotary positions (M-RoPE: Qwen2-VL's family).
            kv_caches: One ``(key_cache, value_cache)`` per layer, written at
                ``meta.slot_mapping``.
            meta: The step's attention metadata.
            backend: The attention implementation.
            inputs_embeds: ``[T, hidden]`` embeddings to use instead of ``input_ids``.
            **decoder_kwargs: More arguments of the transformers decoder's ``forward`` (a
                vision-language subclass's: Qwen3-VL's deepstack features).

        Returns:
            ``[T, hidden]`` final-normed hidden states.

        Raises:
            ValueError: neither ``input_ids`` nor ``inputs_embeds``, or not one KV cache pair
                per layer.
            PagedAttentionBypassed: a decoder layer's attention did not run through the paged
                attention (the load-time probe, :mod:`.probe`, refuses such a model first).
        """
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pass input_ids or inputs_embeds")
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV cache pairs, got {len(kv_caches)}")
        step = PagedStep(kv_caches, meta, backend, self._layer_of)
        with paged_step(step):
            out = self.decoder(
                input_ids=None if inputs_embeds is not None else input_ids[None],
                inputs_embeds=None if inputs_embeds is None else inputs_embeds[None],
                position_ids=positions[None] if positions.dim() == 1 else positions[:, None],
                use_cache=False,
                return_dict=True,
                **decoder_kwargs,
            )
        paged = self.text_config._attn_implementation == ATTN_IMPLEMENTATION
        if paged and sorted(step.calls) != list(range(self.num_layers)):
            raise PagedAttentionBypassed(
                f"the engine's paged attention ran for layers {sorted(step.calls)} of one forward "
                f"pass; each of the {self.num_layers} decoder layers must call it exactly once"
            )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 logits, with the model's own logit transforms.

        The LM head, then what transformers' ``*ForCausalLM.forward`` applies to its output:
        Granite's ``logits_scaling`` (divide), Cohere's ``logit_scale`` (multiply), Gemma 2/3's
        ``final_logit_softcapping`` (``cap * tanh(logits / cap)``).
        """
        logits = self.lm_head(hidden_states)
        cfg = self.text_config
        scaling = getattr(cfg, "logits_scaling", None)
        if scaling is not None and scaling != 1:
            logits = logits / scaling
        scale = getattr(cfg, "logit_scale", None)
        if isinstance(scale, int | float) and scale != 1:
            logits = logits * scale
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits.float()

    def lora_targets(self) -> Iterator[tuple[int, str, nn.Linear]]:
        """Every ``nn.Linear`` of every decoder layer, as ``(layer_idx, name, module)``.

        ``name`` is the leaf module name (``q_proj``) where unique in its layer, else its path
        inside the layer (``adapters.base_model.lora_target_names``).
        """
        for i, layer in enumerate(self.layers):
            modules = dict(layer.named_modules())
            for path, name in self._target_paths[i].items():
                module = modules[path]
                base = getattr(module, "base", module)  # already wrapped in a LoRALinear
                yield i, name, base

    def lora_module_name(self, layer: int, name: str) -> str:
        """A LoRA target's full module name in the transformers model.

        For example ``model.layers.3.self_attn.q_proj``, as a PEFT adapter's tensors name it.
        """
        path = next(p for p, n in self._target_paths[layer].items() if n == name)
        return f"{self._layer_prefix}.{layer}.{path}"
