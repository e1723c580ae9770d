"""Building blocks shared by the decoders: RMSNorm, activations, rotary embedding, gated MLP.

Each block computes exactly what its Hugging Face counterpart computes (same operation order,
same float32 up-casts), so a checkpoint gives the same numbers here as in ``transformers``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.models.fused import FusedLinear

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: (
        0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3.0))))
    ),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name`` in a Hugging Face config (``hidden_act`` and friends).

    Raises:
        ValueError: an activation this engine does not implement.
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
        ) from None


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``y = weight * (x / sqrt(mean(x^2) + eps))``, computed in float32.

    Args:
        hidden_size: Size of the last dimension.
        eps: Added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x``.

        Args:
            x: ``[..., hidden]``.

        Returns:
            ``[..., hidden]`` in ``x``'s dtype.
        """
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (NeoX "rotate half" layout) for given inverse frequencies.

    ``cos/sin[t] = cos/sin(cat(p_t * inv_freq, p_t * inv_freq)) * attention_scaling`` for the
    position ``p_t`` of token ``t``. The frequencies (default, linear, llama3, yarn scaling) are
    computed once from the config, see :func:`engine.models.config.rope_frequencies`.

    Args:
        inv_freq: ``head_dim // 2`` inverse frequencies (float32 values).
        attention_scaling: Factor applied to cos and sin (1.0 except for yarn).
    """

    def __init__(self, inv_freq: Sequence[float], attention_scaling: float = 1.0) -> None:
        super().__init__()
        self._inv_freq_values = tuple(float(f) for f in inv_freq)
        self.attention_scaling = float(attention_scaling)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = torch.tensor(self._inv_freq_values, dtype=torch.float32, device=device)
            self._inv_freq[device] = inv_freq
        return inv_freq

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines for the step's positions.

        Args:
            positions: ``[T]`` int64 absolute positions.
            dtype: Dtype of the returned tables (computed in float32, then cast).

        Returns:
            ``(cos, sin)``, each ``[T, head_dim]``.
        """
        freqs = positions[:, None].float() * self._inv_freq_on(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (halves)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: ``[T, num_heads, head_dim]``.
        cos: ``[T, head_dim]``.
        sin: ``[T, head_dim]``.

    Returns:
        ``[T, num_heads, head_dim]``.
    """
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


class GatedMLP(nn.Module):
    """SwiGLU-style MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``.

    ``gate_proj`` and ``up_proj`` read the same input, so they are one fused GEMM,
    ``gate_up_proj`` (:class:`engine.models.fused.FusedLinear`, rows ``[gate; up]``); the
    checkpoint's separate tensors are copied into its rows at load, and LoRA targets the two
    slices under their Hugging Face names (``engine.lora.layers``).

    Args:
        hidden_size: Model width.
        intermediate_size: MLP width.
        hidden_act: Activation name (``silu`` for Llama, Mistral, Qwen2).
        bias: Whether the projections have biases (Llama's ``mlp_bias``).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool
    ) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(
            hidden_size, (("gate_proj", intermediate_size), ("up_proj", intermediate_size)), bias
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]``."""
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)
