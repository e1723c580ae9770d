"""What adapter validation needs to know about the served base model: its LoRA targets.

An adapter may put LoRA on every ``nn.Linear`` inside a decoder layer of the served model's text
decoder, and on nothing else (vision towers, projectors, embeddings and the output head keep
their weights). :class:`ModelTargets` lists those linears per layer with their shapes, the
decoder layers' module prefix (``model.layers``, ``model.language_model.layers``, ...) and every
other module PEFT could wrap, so target patterns are resolved against the real module names.

It is read off the transformers model itself: :func:`model_targets` builds it from the config on
the meta device (no weights, under a second for a 7B model), :func:`targets_of_model` from a
built model. The engine's models yield the same names from ``lora_targets()`` (the rule is
:func:`lora_target_names`; ``EngineCore`` refuses to start if the two disagree), so the gateway,
which holds only the config or the engine's :class:`adapters.limits.AdapterLimits`, validates
against exactly what the engine applies.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any


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


def find_decoder_layers(decoder: Any, num_layers: int) -> Any:
    """The text decoder's ``nn.ModuleList`` of its ``num_layers`` layers.

    ``decoder.layers`` in nearly every transformers architecture, else the decoder's one child
    ``ModuleList`` of that length (the engine's transformers backend finds its layers the same
    way).

    Raises:
        ValueError: no such list, or more than one.
    """
    from torch import nn

    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    found = [m for m in decoder.children() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if len(found) != 1:
        raise ValueError(f"cannot find the {num_layers} decoder layers of {type(decoder).__name__}")
    return found[0]


@dataclass(frozen=True)
class LinearTarget:
    """One ``nn.Linear`` of a decoder layer that LoRA may adapt.

    Attributes:
        path: Its module path inside the layer (``self_attn.q_proj``).
        name: The engine's name for it (:func:`lora_target_names`; ``q_proj``).
        in_features: Its input size (``lora_A`` is ``[r, in_features]``).
        out_features: Its output size (``lora_B`` is ``[out_features, r]``).
    """

    path: str
    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelTargets:
    """The served model's LoRA targets (see the module docstring).

    Layers with the same targets share one entry of ``kinds`` (an MoE with dense first layers
    has two kinds; most models one).

    Attributes:
        architecture: The transformers class (``Qwen3ForCausalLM``), for messages.
        layers_prefix: The decoder layers' module name (``model.layers``): layer ``i``'s
            target ``t`` is the module ``f"{layers_prefix}.{i}.{t.path}"``.
        kinds: The distinct per-layer target lists.
        layer_kinds: For each decoder layer, its index into ``kinds``.
        others: Every other module PEFT could wrap (embeddings, the output head, vision tower,
            projector, non-``nn.Linear`` layers such as ``Conv1D``) by name, mapped to its kind
            (``"Linear"``, ``"Embedding"``, ``"Conv1D"``, ...).
        head: The output head's module name (``lm_head``; PEFT's ``all-linear`` leaves it
            out), or None.
        multimodal: Whether the model has a vision part (a ``vision_config``).
        legacy_layout: Whether adapters may also name modules as transformers < 4.52 did
            for LLaVA-style models (:mod:`adapters.layouts`).
    """

    architecture: str
    layers_prefix: str
    kinds: tuple[tuple[LinearTarget, ...], ...]
    layer_kinds: tuple[int, ...]
    others: dict[str, str] = field(default_factory=dict)
    head: str | None = "lm_head"
    multimodal: bool = False
    legacy_layout: bool = False

    @classmethod
    def uniform(
        cls,
        architecture: str,
        layers_prefix: str,
        layer: list[LinearTarget],
        num_layers: int,
        **kwargs: Any,
    ) -> ModelTargets:
        """Targets of ``num_layers`` identical layers (``kwargs``: the other attributes)."""
        return cls(architecture, layers_prefix, (tuple(layer),), (0,) * num_layers, **kwargs)

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layer_kinds)

    def layer(self, index: int) -> tuple[LinearTarget, ...]:
        """The targets of decoder layer ``index``."""
        return self.kinds[self.layer_kinds[index]]

    @property
    def names(self) -> tuple[str, ...]:
        """Every target name, in layer order (``q_proj, k_proj, ...``): what may be targeted."""
        seen: dict[str, None] = {}
        for kind in self.kinds:
            seen.update((t.name, None) for t in kind)
        return tuple(seen)

    def shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """``(layer, name) -> (in_features, out_features)`` of every target of every layer."""
        return {
            (i, t.name): (t.in_features, t.out_features)
            for i in range(self.num_layers)
            for t in self.layer(i)
        }

    def total_features(self) -> int:
        """``sum(in_features + out_features)`` over every target of every layer."""
        per_kind = [sum(t.in_features + t.out_features for t in kind) for kind in self.kinds]
        return sum(per_kind[k] for k in self.layer_kinds)

    def num_targets(self) -> int:
        """Targets over all layers (an adapter of everything has twice as many tensors)."""
        return sum(len(self.kinds[k]) for k in self.layer_kinds)

    def peft_target_regex(self, names: tuple[str, ...] | None = None) -> str:
        r"""A PEFT ``target_modules`` regex for these targets in every decoder layer, nothing else.

        PEFT ``re.fullmatch``-es a string ``target_modules`` against every module name, so
        ``model\.language_model\.layers\.\d+\.(?:.*\.)?(?:q_proj|v_proj)`` reaches the
        language model's ``q_proj`` and ``v_proj`` but not the vision tower's.

        Args:
            names: Target names to keep (default: all, :attr:`names`).

        Raises:
            ValueError: a name that is not a target of this model.
        """
        names = self.names if names is None else tuple(names)
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"not LoRA targets of {self.architecture}: {', '.join(unknown)}")
        alternatives = "|".join(re.escape(n) for n in names)
        return rf"{re.escape(self.layers_prefix)}\.\d+\.(?:.*\.)?(?:{alternatives})"

    def summary(self) -> dict[str, Any]:
        """What may be targeted, as JSON: ``GET /v1/models`` and ``loraplex model targets``.

        ``{"architecture", "decoder_layers", "num_layers", "target_modules",
        "target_modules_regex"}``: the decoder layers' module prefix, the target names, and
        :meth:`peft_target_regex`.
        """
        return {
            "architecture": self.architecture,
            "decoder_layers": self.layers_prefix,
            "num_layers": self.num_layers,
            "target_modules": list(self.names),
            "target_modules_regex": self.peft_target_regex(),
        }


@dataclass(frozen=True)
class BaseModelInfo:
    """What ``base_model_name_or_path`` may say to count as the served model.

    Attributes:
        names: The served name and the model directory; only recorded, never a reason to
            refuse.
    """

    names: tuple[str, ...] = ()


def _module_kind(module: Any) -> str | None:
    """The kind of module PEFT's LoRA can wrap (``"Linear"``, ``"Embedding"``, ...), else None.

    By ``isinstance``, as PEFT dispatches (Gemma's scaled embedding is an ``Embedding``), plus
    transformers' ``Conv1D`` by name.
    """
    from torch import nn

    for cls in (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention):
        if isinstance(module, cls):
            return cls.__name__
    return "Conv1D" if type(module).__name__ == "Conv1D" else None


def has_legacy_layout(model_type: str | None) -> bool:
    """Whether transformers renames ``language_model`` to ``model.language_model`` for the type.

    (See :mod:`adapters.layouts`.) Read from transformers' checkpoint conversion mapping (the
    renaming that loads checkpoints and PEFT adapters saved before 4.52); False where
    transformers has none.
    """
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        mapping = get_checkpoint_conversion_mapping(model_type) or []
    except Exception:  # noqa: BLE001 - an older or newer transformers without the mapping
        return False
    return any(
        list(getattr(rule, "source_patterns", None) or []) == ["^language_model"]
        and list(getattr(rule, "target_patterns", None) or []) == ["model.language_model"]
        for rule in mapping
    )


def targets_of_model(hf_model: Any) -> ModelTargets:
    """Read :class:`ModelTargets` off a transformers ``PreTrainedModel`` (meta or real).

    The text decoder is ``hf_model.get_decoder()``; its layers, the one ``ModuleList`` of
    ``get_text_config().num_hidden_layers`` entries (:func:`find_decoder_layers`); each layer's
    targets, every ``nn.Linear`` in it, named by :func:`lora_target_names`.

    Raises:
        ValueError: the decoder's layers cannot be found.
    """
    config = hf_model.config
    num_layers = int(config.get_text_config().num_hidden_layers)
    layers = find_decoder_layers(hf_model.get_decoder(), num_layers)
    names = {id(m): n for n, m in hf_model.named_modules()}
    prefix = names[id(layers)]
    kinds: list[tuple[LinearTarget, ...]] = []
    layer_kinds: list[int] = []
    inside: set[str] = set()
    for i, layer in enumerate(layers):
        linears = {p: m for p, m in layer.named_modules() if _module_kind(m) == "Linear"}
        kind = tuple(
            LinearTarget(path, name, int(m.in_features), int(m.out_features))
            for (path, name), m in zip(
                lora_target_names(list(linears)).items(), linears.values(), strict=True
            )
        )
        if kind not in kinds:
            kinds.append(kind)
        layer_kinds.append(kinds.index(kind))
        inside.update(f"{prefix}.{i}.{path}" for path in linears)
    others = {}
    for name, module in hf_model.named_modules():
        kind = _module_kind(module)
        if kind is not None and name not in inside:
            others[name] = kind
    head = hf_model.get_output_embeddings()
    return ModelTargets(
        architecture=type(hf_model).__name__,
        layers_prefix=prefix,
        kinds=tuple(kinds),
        layer_kinds=tuple(layer_kinds),
        others=others,
        head=names.get(id(head)) if head is not None else None,
        multimodal=getattr(config, "vision_config", None) is not None,
        legacy_layout=has_legacy_layout(getattr(config, "model_type", None)),
    )


def model_targets(hf_config: Any) -> ModelTargets:
    """Build the served model from its transformers config on the meta device; read its targets.

    The class is what transformers' ``AutoModelForImageTextToText`` (a config with a
    ``vision_config``) or ``AutoModelForCausalLM`` maps the config to, as the engine loads it.

    Args:
        hf_config: The served model's transformers config (not modified).

    Returns:
        The targets (:func:`targets_of_model`).

    Raises:
        ValueError: transformers cannot build the architecture, or its decoder layers cannot be
            found.
    """
    import torch
    import transformers

    multimodal = getattr(hf_config, "vision_config", None) is not None
    auto = (
        transformers.AutoModelForImageTextToText
        if multimodal
        else transformers.AutoModelForCausalLM
    )
    try:
        with torch.device("meta"):
            model = auto.from_config(copy.deepcopy(hf_config))
    except Exception as exc:  # transformers raises many types for a config it cannot build
        raise ValueError(
            f"transformers cannot build the model to list its LoRA targets: {exc}"
        ) from exc
    return targets_of_model(model)
