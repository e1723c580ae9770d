"""What adapter validation needs to know about the served base model.

The core of validation takes plain values, so the engine can call it with what its own model
reports: ``target_shapes`` (projection name -> ``(in_features, out_features)``, the same for
every decoder layer) and ``num_layers``. :class:`BaseModelInfo` optionally adds what only the
Hugging Face model knows (is it LLaVA, which other modules exist, what is it called), so target
patterns can be resolved against the real module names and a pattern that also reaches the
vision tower is refused even when the weights file leaves those tensors out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
"""The language-model projections an adapter may target (Hugging Face / PEFT names)."""

# Module classes PEFT can put LoRA on; only their names matter for target resolution.
_LORA_CAPABLE = frozenset({"Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D"})


@dataclass(frozen=True)
class Layout:
    """Where a Hugging Face model keeps its decoder projections.

    Attributes:
        name: ``"llama"`` (``model.layers.N...``), ``"llava"`` (transformers >= 4.52:
            ``model.language_model.layers.N...``) or ``"llava-legacy"`` (older:
            ``language_model.model.layers.N...``).
        decoder_prefix: What precedes ``layers.N`` in a projection's module name.
        multimodal: Whether this is a LLaVA layout.
        description: For error messages.
    """

    name: str
    decoder_prefix: str
    multimodal: bool
    description: str

    def module_name(self, layer: int, projection: str) -> str:
        """The full module name, e.g. ``model.layers.3.mlp.up_proj``."""
        block = "self_attn" if projection in ATTENTION_PROJECTIONS else "mlp"
        return f"{self.decoder_prefix}layers.{layer}.{block}.{projection}"

    def parse(self, module_name: str) -> tuple[int, str] | None:
        """``(layer, projection)`` of a decoder projection's module name, else None."""
        match = _PROJECTION_RE.fullmatch(module_name)
        if match is None or match["prefix"] != self.decoder_prefix:
            return None
        block, projection = match["block"], match["proj"]
        if (block == "self_attn") != (projection in ATTENTION_PROJECTIONS):
            return None
        return int(match["layer"]), projection

    def from_current(self, name: str) -> str:
        """Rename a module from current transformers naming into this layout."""
        if self.name != "llava-legacy":
            return name
        if name == "lm_head":
            return "language_model.lm_head"
        for new, old in _LEGACY_PREFIXES:
            if name.startswith(new):
                return old + name[len(new) :]
        return name


_PROJECTION_RE = re.compile(
    r"(?P<prefix>(?:[^.]+\.)*?)layers\.(?P<layer>0|[1-9][0-9]{0,5})\."
    r"(?P<block>self_attn|mlp)\.(?P<proj>" + "|".join(PROJECTIONS) + ")"
)
_LEGACY_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
LAYOUTS = (
    Layout("llama", "model.", False, "a text-only Llama"),
    Layout("llava", "model.language_model.", True, "a LLaVA model"),
    Layout("llava-legacy", "language_model.model.", True, "a LLaVA model (transformers < 4.52)"),
)
CURRENT_LAYOUT = {False: LAYOUTS[0], True: LAYOUTS[1]}
"""The layout current transformers gives a text-only (False) or multimodal (True) model."""


def lora_target_names(module_paths: list[str]) -> dict[str, str]:
    """The engine's name for each LoRA-capable linear of one decoder layer.

    A linear is named by its leaf (``q_proj``, ``gate_up_proj``, ``dense``: what PEFT's
    ``target_modules`` lists usually say) where that leaf is unique within the layer, else by
    its path inside the layer (``block_sparse_moe.experts.0.w1``), so names stay unique.

    Args:
        module_paths: The linears' paths inside the layer (``self_attn.q_proj``).

    Returns:
        ``path -> name``, in the order given.
    """
    leaves = [path.rsplit(".", 1)[-1] for path in module_paths]
    return {
        path: leaf if leaves.count(leaf) == 1 else path
        for path, leaf in zip(module_paths, leaves, strict=True)
    }


@dataclass(frozen=True)
class BaseModelInfo:
    """Optional facts about the served Hugging Face model (see :func:`base_model_info`).

    Attributes:
        multimodal: True for LLaVA (the decoder sits under ``language_model``), False for a
            plain Llama; None (unknown) accepts the tensor-name layouts of both.
        module_types: Every LoRA-capable module of the Hugging Face model outside the decoder
            projections (embeddings, ``lm_head``, vision tower, projector), by its name in
            current transformers naming, mapped to its class name (``"Linear"``, ...).
        names: What ``base_model_name_or_path`` may say to count as this model (the served
            name, the model directory); only recorded, never a reason to refuse.
    """

    multimodal: bool | None = None
    module_types: Mapping[str, str] = field(default_factory=dict)
    names: tuple[str, ...] = ()


def _text_config(hf_config: Any) -> Any:
    """The decoder part of a Llama (itself) or LLaVA (``text_config``) config."""
    text = getattr(hf_config, "text_config", None)
    return text if text is not None else hf_config


def num_layers_from_config(hf_config: Any) -> int:
    """Decoder layers of a transformers Llama or LLaVA config."""
    return int(_text_config(hf_config).num_hidden_layers)


def target_shapes_from_config(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``projection -> (in_features, out_features)`` of a Llama-family decoder.

    Args:
        hf_config: A transformers ``LlamaConfig`` (Mistral, Qwen2 alike) or ``LlavaConfig``
            (its ``text_config`` is used): ``hidden_size``, ``intermediate_size``,
            ``num_attention_heads``, ``num_key_value_heads`` (default: the heads) and
            ``head_dim`` (default: ``hidden_size // num_attention_heads``).

    Returns:
        A dict over :data:`PROJECTIONS`, e.g. ``q_proj: (hidden, heads * head_dim)``,
        ``down_proj: (intermediate, hidden)``.
    """
    cfg = _text_config(hf_config)
    hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def base_model_info(hf_config: Any, *, names: tuple[str, ...] = ()) -> BaseModelInfo:
    """Build :class:`BaseModelInfo` by instantiating the transformers model on the meta device.

    No weights are allocated (a 7B LLaVA takes under a second). If transformers cannot build
    the architecture, the module list falls back to empty (the tensor names still refuse
    anything outside the decoder projections).

    Args:
        hf_config: The served model's transformers config.
        names: The served model's name and directory.

    Returns:
        The info, ``multimodal`` from the presence of a ``vision_config``.
    """
    multimodal = getattr(hf_config, "vision_config", None) is not None
    module_types: dict[str, str] = {}
    try:
        import torch
        import transformers

        auto = (
            transformers.AutoModelForImageTextToText
            if multimodal
            else transformers.AutoModelForCausalLM
        )
        with torch.device("meta"):
            model = auto.from_config(hf_config)
        for name, module in model.named_modules():
            kind = type(module).__name__
            if kind in _LORA_CAPABLE and CURRENT_LAYOUT[multimodal].parse(name) is None:
                module_types[name] = kind
    except Exception:  # noqa: BLE001 - an unknown architecture only loses the extra check
        module_types = {}
    return BaseModelInfo(multimodal=multimodal, module_types=module_types, names=tuple(names))
