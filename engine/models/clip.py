"""CLIP vision tower, run only as deep as LLaVA's feature layers need.

Hidden state ``0`` is the patch + class embeddings after the pre-layernorm, hidden state ``i``
the output of encoder layer ``i - 1`` (Hugging Face's ``hidden_states`` tuple). The
post-layernorm only feeds CLIP's pooled output, which LLaVA never reads, so it is not built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.models.config import VisionConfig
from loraplex.engine.models.layers import get_activation


class CLIPVisionEmbeddings(nn.Module):
    """Patch embedding (a stride-``patch`` conv), class token and learned positions.

    Args:
        config: The tower config.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.class_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W] -> [N, 1 + num_patches, hidden]`` (class token first)."""
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(
                f"image size {height}x{width} does not match the vision tower's "
                f"{self.image_size}x{self.image_size}"
            )
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [N, hidden, g, g]
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens.

    Args:
        config: The tower config.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = hidden // config.num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, S, hidden] -> [N, S, hidden]``."""
        n, s, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, s, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # [N, heads, S, D]
        return self.out_proj(out.transpose(1, 2).reshape(n, s, hidden))


class CLIPMLP(nn.Module):
    """``fc2(act(fc1(x)))``.

    Args:
        config: The tower config.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., hidden]``."""
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer block: ``h = x + attn(ln1(x)); out = h + mlp(ln2(h))``.

    Args:
        config: The tower config.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, S, hidden] -> [N, S, hidden]``."""
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class CLIPEncoder(nn.Module):
    """The first ``config.num_layers_run`` encoder layers (Hugging Face's ``encoder.layers``).

    Args:
        config: The tower config.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(config.num_layers_run))


class CLIPVisionTower(nn.Module):
    """CLIP ViT returning LLaVA's selected feature layers, class token dropped or kept.

    Args:
        config: The tower config.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image features, the selected hidden states concatenated on the last dimension.

        Args:
            pixel_values: ``[N, C, image_size, image_size]`` normalized pixels.

        Returns:
            ``[N, num_image_tokens, hidden * len(feature_layers)]``.
        """
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        hidden_states = [h]
        for layer in self.encoder.layers:
            h = layer(h)
            hidden_states.append(h)
        start = 0 if self.config.keep_cls else 1
        selected = [hidden_states[i][:, start:] for i in self.config.feature_layers]
        return selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
