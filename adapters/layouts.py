"""How an adapter's tensor names may spell the served model's modules: its layouts.

PEFT names an adapter's tensors after the modules of the model it was trained on. An adapter
made with the transformers release that serves the model uses the model's own names (the
*current* layout: its decoder layers at :attr:`adapters.base_model.ModelTargets.layers_prefix`).
transformers 4.52 moved the parts of LLaVA-style vision-language models (LLaVA, LLaVA-NeXT,
LLaVA-OneVision, Gemma 3, Mistral 3, PaliGemma, ...): ``language_model.model.X`` became
``model.language_model.X``, ``vision_tower.X`` ``model.vision_tower.X``,
``multi_modal_projector.X`` ``model.multi_modal_projector.X`` and ``language_model.lm_head``
``lm_head``. Adapters trained before still load in PEFT (transformers' checkpoint conversion
mapping renames them), so for the models transformers renames that way the *legacy* layout is
accepted too. One adapter file uses one layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.adapters.base_model import ModelTargets

_LEGACY_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_KNOWN_PREFIXES = {
    "model.layers": "a text-only Llama or similar model",
    "model.language_model.layers": "a LLaVA or similar vision-language model",
    "language_model.model.layers": (
        "a LLaVA or similar vision-language model saved by transformers < 4.52"
    ),
    "model.text_model.layers": "an Idefics3 or similar vision-language model",
}
"""Decoder-layer prefixes of common layouts, described for messages."""


@dataclass(frozen=True)
class Layout:
    """One way of naming the served model's modules.

    Attributes:
        layers_prefix: The decoder layers' module name in this layout.
        legacy: Whether this is the pre-4.52 LLaVA-style layout (module names are renamed
            from the current ones by :meth:`from_current`).
    """

    layers_prefix: str
    legacy: bool = False

    @property
    def name(self) -> str:
        """For messages: ``model.layers``, or ``language_model.model.layers (legacy)``."""
        return self.layers_prefix + (" (legacy)" if self.legacy else "")

    def module_name(self, layer: int, path: str) -> str:
        """A target's full module name, e.g. ``model.layers.3.mlp.up_proj``."""
        return f"{self.layers_prefix}.{layer}.{path}"

    def from_current(self, name: str) -> str:
        """Rename a module from current transformers naming into this layout."""
        return _legacy_name(name) if self.legacy else name


def _legacy_name(name: str) -> str:
    """A module's name as transformers < 4.52 spelled it in a LLaVA-style model."""
    if name == "lm_head":
        return "language_model.lm_head"
    for new, old in _LEGACY_PREFIXES:
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def layouts_of(targets: ModelTargets) -> tuple[Layout, ...]:
    """The layouts an adapter for the served model may use, the current one first."""
    current = Layout(targets.layers_prefix)
    legacy = Layout(_legacy_name(targets.layers_prefix), legacy=True)
    if targets.legacy_layout and legacy.layers_prefix != current.layers_prefix:
        return (current, legacy)
    return (current,)


def describe_layers(prefix: str) -> str:
    """What kind of model keeps its decoder layers at ``prefix``, for messages."""
    kind = _KNOWN_PREFIXES.get(prefix, "a model")
    return f"{kind} (decoder layers {prefix}.N)"


def known_prefix(prefix: str) -> bool:
    """Whether ``prefix`` is a common layout's decoder-layer prefix (:func:`describe_layers`)."""
    return prefix in _KNOWN_PREFIXES
