"""Where the engine finds an adapter's weights by digest: a registered directory or the store.

The LoRA manager (``engine.lora.slots``) keeps adapters in host memory and device slots and asks
:meth:`AdapterRegistry.load` for one it does not hold (first use, or evicted from the CPU
tier). Adapters added from a directory (``LLM``, ``loraplex generate``) are re-read from it;
the server's tenants' adapters come from the content-addressed store through ``loader``.
Everything an adapter is validated against travels as one frozen :class:`AdapterLimits`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.limits import AdapterLimits


class AdapterRegistry:
    """Adapters by digest: registered directories first, then ``loader`` (the store).

    Args:
        limits: What adapters are validated against.
        loader: ``digest -> LoraAdapter`` for adapters not registered from a directory; None
            when there is no store (offline use).
    """

    def __init__(self, limits: AdapterLimits, loader: Callable[[str], Any] | None = None) -> None:
        self.limits = limits
        self._loader = loader
        self._dirs: dict[str, str] = {}

    def add_dir(self, path: str | os.PathLike[str]) -> Any:
        """Validate a PEFT LoRA directory and register it by its digest.

        Returns:
            The validated ``LoraAdapter``.

        Raises:
            AdapterError: the adapter is invalid for this model (a ValueError).
        """
        adapter = self.read(path)
        self._dirs[adapter.digest] = str(path)
        return adapter

    def forget(self, digest: str) -> None:
        """Unregister a directory (the store, if any, may still have the digest)."""
        self._dirs.pop(digest, None)

    def known(self, digest: str) -> bool:
        """Whether the digest can be loaded (a registered directory, or a store to ask)."""
        return digest in self._dirs or self._loader is not None

    def load(self, digest: str) -> Any:
        """The adapter of ``digest``, validated (the LoRA manager's loader).

        Raises:
            AdapterError: unknown digest, or a directory whose adapter changed on disk.
            KeyError: the store has no such adapter.
        """
        path = self._dirs.get(digest)
        if path is not None:
            adapter = self.read(path)
            if adapter.digest != digest:
                raise AdapterError(f"the adapter at {path} changed on disk")
            return adapter
        if self._loader is not None:
            return self._loader(digest)
        raise AdapterError(f"unknown adapter {digest}")

    def read(self, path: str | os.PathLike[str]) -> Any:
        """Validate a PEFT LoRA directory against the limits, without registering it.

        Raises:
            AdapterError: the adapter is invalid for this model.
        """
        from loraplex.adapters.validation import load_adapter_dir

        return load_adapter_dir(path, limits=self.limits)
