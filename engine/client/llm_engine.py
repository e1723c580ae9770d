"""``LLMEngine``: the engine core with its client side, in one process.

::

    add_request(request)   -> output processor tracks it, core validates and queues it
    step()                 -> core.step()                         token ids per sequence
                              output_processor.process(...)       text, stop strings, outputs
                              core.finish_request(...)            stop strings found, back
                           -> list[RequestOutput]

``LLM`` drives it to completion for a batch, in the caller's thread. For streaming, the front
``engine.client.front.AsyncLLM`` holds the same two halves on either side of an
``engine.client.core_client.EngineCoreClient`` (a thread, a process, a Ray actor or a router);
``AsyncLLM.in_process(engine=...)`` serves this engine's core and processor that way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplex.adapters.limits import AdapterLimits
from loraplex.engine.client.output_processor import OutputProcessor
from loraplex.engine.client.processing import load_processor
from loraplex.engine.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.errors import rejection_error
from loraplex.engine.models.source import resolve_model_source
from loraplex.engine.request import EngineRequest, RequestOutput


class LLMEngine:
    """An :class:`EngineCore` and its :class:`OutputProcessor`, driven one step at a time.

    Args:
        config: The engine configuration.
        adapter_loader: ``digest -> LoraAdapter`` for adapters the engine was not handed
            directly (see :class:`EngineCore`).

    Raises:
        ValueError: what :class:`EngineCore` raises (a model source that names nothing
            loadable included), or a directory without a usable tokenizer / processor.
    """

    def __init__(
        self, config: EngineConfig, *, adapter_loader: Callable[[str], Any] | None = None
    ) -> None:
        config = resolve_model_source(config)  # a Hub id or GGUF file: a directory, once
        self.core = EngineCore(config, adapter_loader=adapter_loader)
        self.config = self.core.config
        self.tokenizer, self.inputs = load_processor(
            config.model,
            self.core.model,
            config.mm_hash,
            max_images=config.max_images,
            max_image_pixels=config.max_image_pixels,
            max_image_aspect_ratio=config.max_image_aspect_ratio,
            max_request_image_pixels=config.max_request_image_pixels,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.core.structured.use_tokenizer(self.tokenizer)  # not read a second time
        self._rejected: list[tuple[str, Exception]] = []

    # The core's parts, for statistics, benchmarks and tests.
    @property
    def model(self) -> Any:
        """The loaded model."""
        return self.core.model

    @property
    def kv(self) -> Any:
        """The KV cache manager."""
        return self.core.kv

    @property
    def scheduler(self) -> Any:
        """The scheduler."""
        return self.core.scheduler

    @property
    def runner(self) -> Any:
        """The model runner."""
        return self.core.runner

    @property
    def lora_manager(self) -> Any:
        """The LoRA manager."""
        return self.core.lora_manager

    @property
    def kv_sizing(self) -> Any:
        """How the KV pool was sized (``engine.kv_cache.sizing.KVPoolSizing``)."""
        return self.core.kv_sizing

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) of one sequence."""
        return self.core.max_model_len

    @property
    def adapter_limits(self) -> AdapterLimits:
        """What adapters must fit, as one object (validation, stores, upload limits)."""
        return self.core.adapter_limits

    @property
    def lora_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """``(layer, target name) -> (in_features, out_features)`` an adapter may target."""
        return self.core.lora_shapes

    @property
    def step_stats(self) -> Any:
        """The core's step timings (``engine.core.engine_core.StepStats``)."""
        return self.core.step_stats

    @property
    def requests(self) -> dict[str, Any]:
        """The core's in-flight requests (their sequences), by id."""
        return self.core.scheduler.requests

    # ----------------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        """Track and queue a request.

        Raises:
            ValueError: a duplicate id, or what the core refuses.
        """
        self.output_processor.add_request(request)
        try:
            self.core.add_request(request)
        except BaseException:
            self.output_processor.remove(request.request_id)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request at any time; its blocks are freed at once.

        Returns:
            Its final output (finish reason ``"abort"``), None for an unknown id.
        """
        self.core.abort_request(request_id)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight (or a rejection is not taken yet)."""
        return (
            self.output_processor.has_unfinished_requests()
            or self.core.has_unfinished_requests()
            or bool(self._rejected)
        )

    def step(self) -> list[RequestOutput]:
        """One core step, turned into request outputs.

        Returns:
            ``DELTA`` requests: an output for each with news; ``FINAL_ONLY``: each finished.

        Raises:
            EngineFaultError: the core cannot run steps any more.
        """
        processed = self.output_processor.process(self.core.step())
        for f in processed.finish:
            self.core.finish_request(f.request_id, f.reason, f.stop_reason, f.index)
        for rid, message, kind in self.core.take_rejected():
            self.output_processor.remove(rid)
            self._rejected.append((rid, rejection_error(message, kind)))
        return processed.request_outputs

    def take_rejected(self) -> list[tuple[str, Exception]]:
        """Requests the core refused after admission (their grammar), with the error to raise.

        ``StructuredOutputError`` (a ValueError: the client's 400) for a refused spec,
        ``RequestFailedError`` when the grammar sandbox could not run.
        """
        rejected, self._rejected = self._rejected, []
        return rejected

    def shutdown(self) -> None:
        """Stop the core's helpers (the grammar sandbox)."""
        self.core.shutdown()

    # ------------------------------------------------------------------------ adapters
    def add_lora_dir(self, path: str) -> Any:
        """See :meth:`EngineCore.add_lora_dir`."""
        return self.core.add_lora_dir(path)

    def add_lora(self, adapter: Any) -> None:
        """See :meth:`EngineCore.add_lora`."""
        self.core.add_lora(adapter)

    def remove_lora(self, digest: str) -> bool:
        """See :meth:`EngineCore.remove_lora`."""
        return self.core.remove_lora(digest)

    def stats(self) -> dict[str, Any]:
        """See :meth:`EngineCore.stats`."""
        return self.core.stats()
