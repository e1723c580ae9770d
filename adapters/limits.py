"""What adapters must fit: the served model's targets and the largest rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.adapters.base_model import ModelTargets


@dataclass(frozen=True)
class AdapterLimits:
    """What an adapter is validated against (``adapters.validation``), as one object.

    The engine core makes it from the served model (``EngineCore.adapter_limits``); the store,
    the registry, the gateway's upload limits and the core process's adapter loader all take it
    whole (it travels to the gateway in the core's ``CoreInfo``).

    Attributes:
        targets: The served model's LoRA targets (names, per-layer shapes, decoder-layer
            prefix) and other modules (:class:`adapters.base_model.ModelTargets`).
        max_rank: ``--max-lora-rank``.
    """

    targets: ModelTargets
    max_rank: int

    @property
    def num_layers(self) -> int:
        """Decoder layers of the served model."""
        return self.targets.num_layers

    @property
    def target_names(self) -> tuple[str, ...]:
        """What an adapter may target (``q_proj``, ..., or Phi-3's ``qkv_proj``, ...)."""
        return self.targets.names

    def summary(self) -> dict[str, Any]:
        """What an adapter for the served model may target, and at most at which rank, as JSON.

        :meth:`adapters.base_model.ModelTargets.summary` plus ``"max_rank"``.
        """
        return {**self.targets.summary(), "max_rank": self.max_rank}
