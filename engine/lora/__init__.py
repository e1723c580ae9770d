"""Per-request LoRA in the engine: device slots, the LoRA layers and the backends.

``slots`` keeps adapters in host memory and device slots (S-LoRA's tiers, LRU); ``layers``
wraps the model's targeted projections; ``targets`` gives adapter validation the served model's
targets and checks them against the model's own; ``backend`` is the interface of the
arithmetic, with ``torch_backend`` (CPU, any device) and ``triton_backend`` (Punica's
shrink/expand kernels), each preparing its own per-step metadata (vLLM's
``PunicaWrapper.update_metadata``). Parsing, validation and storage of adapters stay in
``adapters/`` (docs/adapters.md).
"""
