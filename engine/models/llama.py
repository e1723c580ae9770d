"""The Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache.

One forward runs one engine step: the step's tokens of every sequence, flattened to ``[T]``
(prefill chunks and decodes mixed). Each attention layer hands its new K/V and its queries to
the attention backend, which writes K/V into the layer's paged cache through
``meta.slot_mapping`` and attends through ``meta.block_tables``; nothing else holds K/V.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.N.self_attn.o_proj``
and so on), except that q/k/v are one fused GEMM, ``self_attn.qkv_proj``, and gate/up another,
``mlp.gate_up_proj`` (:class:`engine.models.fused.FusedLinear`); the loader copies the
checkpoint's separate tensors into their rows. LoRA still targets the seven projections by their
Hugging Face names: :meth:`LlamaForCausalLM.lora_targets` yields the fused modules' slices.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from loraplex.engine.attention import AttentionBackend, AttentionMetadata
from loraplex.engine.models.config import DecoderConfig
from loraplex.engine.models.fused import FusedLinear, LinearSlice, fused_slices
from loraplex.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The LoRA target names of a layer, in order (the fused modules' slices among them)."""


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary embedding, reading K/V through block tables.

    Args:
        config: The decoder config.
        layer_idx: Index of this layer (selects its sliding window).
    """

    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        hidden, q_size = config.hidden_size, config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = FusedLinear(
            hidden, (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)), config.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Attend the step's tokens over their sequences' cached context.

        Args:
            x: ``[T, hidden]`` normed hidden states.
            cos: ``[T, head_dim]`` rotary cosines of the tokens' positions.
            sin: ``[T, head_dim]`` rotary sines.
            kv_cache: This layer's ``(key_cache, value_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``; written in place.
            meta: The step's attention metadata.
            backend: The attention implementation.

        Returns:
            ``[T, hidden]``.
        """
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # one GEMM, three column views
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        key_cache, value_cache = kv_cache
        out = backend.forward(
            q, k, v, key_cache, value_cache, meta, self.scale, sliding_window=self.sliding_window
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``.

    Args:
        config: The decoder config.
        layer_idx: Index of this layer.
    """

    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]``; see :meth:`LlamaAttention.forward` for the rest."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (Hugging Face's ``model.*``).

    Args:
        config: The decoder config.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope_inv_freq, config.rope_attention_scaling)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM over the paged KV cache.

    Args:
        config: The decoder config.
    """

    supports_cuda_graphs = True
    """Its forward over a pure-decode step makes no host read of device values and no
    value-dependent branch, so it can be captured (``engine.runner.cuda_graphs``)."""

    supports_prepacked_weights = True
    """It only calls its linears (no read of a projection's weight after load), so they can be
    oneDNN-prepacked on the CPU (``engine.models.packed_linear``)."""

    supports_compile = True
    """Its forward calls its attention backend once per layer and branches on no tensor value,
    so ``engine.runner.compiled_step`` can compile it whole."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding matrix (call again after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # Properties the model runner sizes the KV pool and the batch with.
    @property
    def num_layers(self) -> int:
        """Decoder layers (one ``(k_cache, v_cache)`` pair each)."""
        return self.config.num_layers

    @property
    def num_heads(self) -> int:
        """Query heads."""
        return self.config.num_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer."""
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Per-head size."""
        return self.config.head_dim

    @property
    def hidden_size(self) -> int:
        """Model width."""
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""
        return self.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        """The model's longest context."""
        return self.config.max_position_embeddings

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights and activations."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.model.embed_tokens.weight.device

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ``[T] -> [T, hidden]``."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: ``[T]`` int64 token ids (ignored when ``inputs_embeds`` is given).
            positions: ``[T]`` int64 absolute position of each token in its sequence.
            kv_caches: One ``(key_cache, value_cache)`` per layer, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``; this step's K/V are
                written into them at ``meta.slot_mapping``.
            meta: The step's attention metadata (flattened sequences).
            backend: The attention implementation.
            inputs_embeds: ``[T, hidden]`` embeddings to use instead of ``input_ids`` (image
                features already spliced in at the image-token positions).

        Returns:
            ``[T, hidden]`` final-normed hidden states (feed the rows to sample from to
            :meth:`compute_logits`).
        """
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pass input_ids or inputs_embeds")
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV cache pairs, got {len(kv_caches)}")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, meta, backend)
        return self.model.norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 logits."""
        return self.lm_head(hidden_states).float()

    def lora_targets(self) -> Iterator[tuple[int, str, nn.Linear | LinearSlice]]:
        """The projections LoRA deltas attach to, as ``(layer_idx, name, module)``.

        ``name`` is Hugging Face's (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
        ``gate_proj``, ``up_proj``, ``down_proj``), as PEFT's ``target_modules`` names them.
        ``o_proj`` and ``down_proj`` are ``nn.Linear`` modules; the others are
        :class:`~engine.models.fused.LinearSlice` views of the fused ``qkv_proj`` and
        ``gate_up_proj`` (same ``in_features``/``out_features``; ``engine.lora.layers`` wraps
        the fused module once, with exact per-slice deltas).
        """
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for piece in fused_slices(attn.qkv_proj):
                yield i, piece.name, piece
            yield i, "o_proj", attn.o_proj
            for piece in fused_slices(mlp.gate_up_proj):
                yield i, piece.name, piece
            yield i, "down_proj", mlp.down_proj
