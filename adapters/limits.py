"""What adapters must fit: the served model's targets, layers and the largest rank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterLimits:
    """What an adapter is validated against (``adapters.validation``), as one object.

    The engine core makes it from the served model (``EngineCore.adapter_limits``); the store,
    the registry, the gateway's upload limits and the core process's adapter loader all take it
    whole.

    Attributes:
        target_shapes: ``projection name -> (in_features, out_features)`` of the served model.
        num_layers: Decoder layers of the served model.
        max_rank: ``--max-lora-rank``.
    """

    target_shapes: dict[str, tuple[int, int]]
    num_layers: int
    max_rank: int
