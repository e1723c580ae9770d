"""The served model's LoRA targets as adapter validation sees them, checked against the engine's.

Validation (``adapters/``) knows the model through :class:`adapters.base_model.ModelTargets`:
the transformers model's decoder-layer ``nn.Linear`` modules, their names and shapes. The engine
applies LoRA to what its model yields from ``lora_targets()``. :func:`served_targets` makes the
first and refuses to start when it differs from the second, so an adapter that validates is one
the engine can apply, module for module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from loraplex.adapters.base_model import ModelTargets, model_targets, targets_of_model
from loraplex.engine.lora.layers import target_shapes


def served_targets(model: nn.Module, hf_config: Any) -> ModelTargets:
    """The :class:`ModelTargets` adapters for ``model`` are validated against.

    Read off the transformers model itself for the transformers backend (its ``hf``
    attribute), else built from ``hf_config`` on the meta device (the native models follow the
    transformers layout of their architecture).

    Args:
        model: An engine model (``engine.models``), before :func:`.layers.install_lora`.
        hf_config: Its transformers config.

    Raises:
        ValueError: the targets transformers' model has and those ``model.lora_targets()``
            yields differ (names, layers or shapes).
    """
    hf_model = getattr(model, "hf", None)
    targets = (
        targets_of_model(hf_model) if isinstance(hf_model, nn.Module) else model_targets(hf_config)
    )
    engine = target_shapes(model)
    expected = targets.shapes()
    if engine != expected:
        missing = sorted(set(expected) - set(engine))[:4]
        extra = sorted(set(engine) - set(expected))[:4]
        shapes = sorted(k for k in set(engine) & set(expected) if engine[k] != expected[k])[:4]
        raise ValueError(
            f"the engine's LoRA targets differ from {targets.architecture}'s: missing {missing}, "
            f"extra {extra}, other shapes {shapes}"
        )
    return targets
