"""Adapters as data: PEFT parsing, validation, targets and patterns, the stores and the registry.

Nothing here touches a device: the LoRA layers, the device slots (the stacked A/B weights and
their LRU) and the backends that compute the deltas are the engine's (``engine.lora``,
docs/engine.md). What an adapter must fit travels as one :class:`adapters.limits.AdapterLimits`.
This package never imports ``engine`` or ``gateway`` (tests/test_repo.py).
"""
