"""``AsyncLLM``: the one front of the engine (vLLM v1's ``AsyncLLM``, at loraplex's size).

The front is the only place with a tokenizer, an input processor (chat template, images) and
its :class:`~engine.client.fair_pool.FairWorkerPool`, an
:class:`~engine.client.output_processor.OutputProcessor` (detokenizers, stop strings, delta
outputs) and the per-request streams. Below it is one
:class:`~engine.client.core_client.EngineCoreClient`, which deals only in token ids: a core on
a thread (``engine.client.inproc``), in a process or a Ray actor (``engine.client.process``),
or a router over several (``engine.client.replicas``). The front does not know which::

    process(messages)   worker pool: chat template, tokenizer, images -> ProcessedPrompt
    generate(request)   output processor tracks it; block hashes once (for a router);
                        core.add_request(...)
    core thread         sink.on_outputs(core outputs) -> output processor -> streams
                        stop strings found -> core.finish_requests(...)

A consumer that stops iterating (client disconnect, cancellation) aborts its request, which
frees its blocks at the core's next step boundary. The gateway serves one front
(``gateway.server.build.start_engine``); ``LLM`` (``engine.client.llm``) is the synchronous loop
over the same output processor with the core in the caller's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from loraplex.engine.client.core_client import EngineCoreClient
from loraplex.engine.client.fair_pool import FairWorkerPool, default_workers
from loraplex.engine.client.inputs import ProcessedPrompt
from loraplex.engine.client.output_processor import OutputProcessor
from loraplex.engine.client.streams import StreamState, put_all, read_outputs
from loraplex.engine.errors import EngineDeadError, RequestFailedError
from loraplex.engine.request import EngineRequest, RequestOutput

__all__ = ["AsyncLLM", "EngineDeadError", "InputLimits", "RequestFailedError", "decode", "encode"]


@dataclass(frozen=True)
class InputLimits:
    """What the gateway checks before it asks the front to process a prompt.

    Attributes:
        max_token_bytes: The most UTF-8 bytes of text one token can stand for (the longest
            token of the vocabulary, special tokens included; doubled when the tokenizer
            normalizes text, which may shrink it); 0 when unknown (no check).
        image_tokens: Placeholder tokens each image takes in the prompt.
        max_images: Most images in one request.
        tool_call_format: The tool-call syntax the chat template teaches the model
            (``gateway.domains.chat.tool_calls.FORMATS``), None when it teaches none.
        vocab_size: Token ids a request may carry are in ``[0, vocab_size)`` (the model's
            vocabulary, as the engine checks it); 0 when unknown: ids are then only kept
            within int64, what can cross to an engine core.
    """

    max_token_bytes: int = 0
    image_tokens: int = 0
    max_images: int = 8
    tool_call_format: str | None = None
    vocab_size: int = 0


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids with a transformers tokenizer."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    """The text of ``token_ids`` (special tokens kept).

    Raises:
        ValueError: an id outside ``[0, len(tokenizer))``.
    """
    size = len(tokenizer)
    if any(not 0 <= t < size for t in token_ids):
        raise ValueError(f"token ids must be in [0, {size})")
    return tokenizer.decode(token_ids, skip_special_tokens=False)


class AsyncLLM:
    """The asynchronous streaming front over one core client.

    Args:
        core: The core client (started: its ``info`` is set).
        config: The ``EngineConfig`` (the model directory, image limits, prefix hash); its model
            source is resolved here unless it is already (``engine.models.source``).
        model_name: Name of the base model in the API (default: ``config.served_model_name``,
            which resolution sets: the Hub id, the GGUF file's stem or the directory's name).
        processor: ``(tokenizer, input processor)`` already loaded (an ``LLMEngine``'s),
            else loaded here from the model directory.
        workers: Threads of the input worker pool (default ``default_workers()``).

    Attributes:
        core: The core client.
        tokenizer: The model's tokenizer.
        inputs: The input processor (``engine.client.processing``): messages to a prompt.
        max_model_len: Most tokens (prompt + completion) of one sequence.
        adapter_limits: What adapters must fit (``adapters.limits.AdapterLimits``).
        input_limits: Cheap bounds on a prompt, checked before it is processed.

    Raises:
        ValueError: the model directory has no usable tokenizer or processor.
    """

    def __init__(
        self,
        core: EngineCoreClient,
        config: Any,
        *,
        model_name: str | None = None,
        processor: tuple[Any, Any] | None = None,
        workers: int | None = None,
    ) -> None:
        from pathlib import Path

        from loraplex.engine.client.processing import load_processor, max_token_bytes
        from loraplex.engine.models.source import resolve_model_source
        from loraplex.engine.sampling.logprobs import TokenBytes
        from loraplex.engine.structured_output.tool_call_format import detect_tool_call_format

        config = resolve_model_source(config)  # a no-op on the config the core started from
        info = core.info
        self.core = core
        self.config = config
        self.model_name = model_name or config.served_model_name or Path(config.model).name
        if processor is None:
            shape = SimpleNamespace(
                image_token_id=info.image_token_id, num_image_tokens=info.num_image_tokens
            )
            processor = load_processor(
                config.model,
                shape,
                config.mm_hash,
                max_images=config.max_images,
                max_image_pixels=config.max_image_pixels,
                max_image_aspect_ratio=config.max_image_aspect_ratio,
                max_request_image_pixels=config.max_request_image_pixels,
            )
        self.tokenizer, self.inputs = processor
        self.max_model_len = info.max_model_len
        self.adapter_limits = info.adapter_limits
        self.input_limits = InputLimits(
            max_token_bytes=max_token_bytes(self.tokenizer),
            image_tokens=info.num_image_tokens,
            max_images=self.inputs.max_images,
            tool_call_format=detect_tool_call_format(self.inputs.chat_template),
            vocab_size=info.vocab_size,
        )
        self._token_bytes = TokenBytes(self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()  # output processor and streams (core thread, loops)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._workers = FairWorkerPool(workers or default_workers())
        core.set_sink(self)

    @classmethod
    def in_process(
        cls,
        config: Any = None,
        *,
        engine: Any = None,
        adapter_loader: Any = None,
        model_name: str | None = None,
    ) -> AsyncLLM:
        """A front over a core on a thread of this process (``engine.client.inproc``).

        Args:
            config: The engine configuration (an engine is built from it).
            engine: An ``LLMEngine`` already built (tests share one model): its core and
                processor are used, and left running (its grammar sandbox too) when this stops.
            adapter_loader: ``digest -> LoraAdapter`` for the engine built here.
            model_name: See :class:`AsyncLLM`.

        Raises:
            ValueError: neither a config nor an engine, or an unusable model.
        """
        from loraplex.engine.client.inproc import InprocCoreClient
        from loraplex.engine.client.llm_engine import LLMEngine

        owns = engine is None
        if engine is None:
            if config is None:
                raise ValueError("AsyncLLM.in_process needs a config or an engine")
            engine = LLMEngine(config, adapter_loader=adapter_loader)
        core = InprocCoreClient(engine.core, owns_core=owns)
        return cls(
            core,
            engine.config,
            model_name=model_name,
            processor=(engine.tokenizer, engine.inputs),
        )

    # ----------------------------------------------------------------------- liveness
    @property
    def is_running(self) -> bool:
        """True while the core can take requests (False while a core process restarts)."""
        return self.core.is_running

    @property
    def recovering(self) -> bool:
        """No core runs but one is being restarted (the gateway waits instead of exiting)."""
        return self.core.recovering

    def describe(self) -> dict[str, Any]:
        """What was loaded (the core client's ``describe``).

        ``num_parameters``, ``dtype``, ``device``, ``kv_pool``, ``pid`` (None in process),
        and ``replicas`` behind a router.
        """
        return self.core.describe()

    def stats(self) -> dict[str, Any]:
        """The core client's scheduler and cache figures.

        ``EngineCore.stats`` keys, with a process client's ``engine_core_deaths`` and
        ``quarantine_refusals``, a router's ``replicas``, ``replicas_running`` and ``routed``.
        """
        return dict(self.core.stats())

    def drain_kv_events(self) -> list[Any]:
        """The core's KV events since the last call (``engine.kv_cache.events``).

        None behind a router: it consumes its replicas' events itself.
        """
        return self.core.drain_kv_events()

    # ------------------------------------------------------------------------- inputs
    async def process(
        self, messages: Any, *, tenant: str = "", tools: list[dict] | None = None
    ) -> ProcessedPrompt:
        """Chat messages (and tools, for the template) to prompt token ids and images.

        Runs on a worker shared fairly by tenants.

        Raises:
            ValueError: bad messages or images (``InvalidImageError`` is one).
            PoolBusyError: the tenant has too many prompts waiting to be processed.
        """
        return await self._workers.run(tenant, self.inputs, messages, tools)

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = True, tenant: str = ""
    ) -> list[int]:
        """``text``'s token ids, on the tenants' shared workers.

        Raises:
            PoolBusyError: the tenant has too many jobs waiting.
        """
        return await self._workers.run(tenant, encode, self.tokenizer, text, add_special_tokens)

    async def detokenize(self, token_ids: list[int], *, tenant: str = "") -> str:
        """The text of ``token_ids`` (special tokens kept), on the tenants' shared workers.

        Raises:
            ValueError: an id outside the vocabulary.
            PoolBusyError: the tenant has too many jobs waiting.
        """
        return await self._workers.run(tenant, decode, self.tokenizer, token_ids)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's exact UTF-8 bytes (OpenAI logprobs' ``bytes`` and ``token``)."""
        return self._token_bytes(token_ids)

    # ----------------------------------------------------------------------- requests
    def _block_hashes(self, request: EngineRequest) -> list[bytes]:
        """The request's block hashes, for a router that reads them (computed once here)."""
        if not self.core.wants_block_hashes:
            return []
        return request.block_hasher(self.config.block_size, self.config.prefix_hash).block_hashes

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as steps produce them, the last finished.

        Raises:
            ValueError: the core refused it (``StructuredOutputError`` for a structured output
                it cannot enforce; ``QueryOfDeathError``), or its id is in flight.
            RequestFailedError: a fault admitting it.
            EngineDeadError: no core is running, or its core died while it ran.
            TenantThrottledError: the tenant's requests keep being in flight at core deaths.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        hashes = self._block_hashes(request)
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in flight")
            self.output_processor.add_request(request)
            self._streams[rid] = (loop, stream)
            try:
                self.core.add_request(request, hashes)
            except BaseException:
                self._streams.pop(rid, None)
                self.output_processor.remove(rid)
                raise
        state = StreamState()
        try:
            async for item in read_outputs(stream, state):
                yield item
        finally:
            with self._lock:
                self._streams.pop(rid, None)
                if not state.finished:
                    self.output_processor.abort(rid)
            if not state.finished:
                self.core.abort(rid)
            self.core.release(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish reason ``"abort"``."""
        with self._lock:
            out = self.output_processor.abort(request_id)
        self.core.abort(request_id)
        if out is not None:
            self._deliver(request_id, out)

    # ----------------------------------------------------------------------- adapters
    async def add_lora(self, adapter: Any) -> None:
        """Make a validated adapter (a ``LoraAdapter``) available by its digest.

        A core in another process reads it from the adapter store by its digest.

        Raises:
            RuntimeError: the core could not load it.
            EngineDeadError: no core is running.
        """
        await self.core.add_lora(adapter)

    async def remove_lora(self, digest: str) -> bool:
        """Drop an adapter from memory; False while a running request uses it."""
        return await self.core.remove_lora(digest)

    def shutdown(self) -> None:
        """Abort everything, stop the core client and the input workers."""
        self.core.shutdown()
        self._workers.shutdown()

    # --------------------------------------------------- the sink (core client's thread)
    def on_outputs(self, outputs: list) -> None:
        """Core outputs to request outputs, handed to their streams (one wake-up per loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            processed = self.output_processor.process(outputs)
            for out in processed.request_outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        if processed.finish:  # stop strings found here: the core stops them
            self.core.finish_requests(processed.finish)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def on_error(self, request_id: str, error: BaseException) -> None:
        """One request ends with ``error`` (refused, or its core died)."""
        with self._lock:
            self.output_processor.remove(request_id)
        self._deliver(request_id, error)

    def on_dead(self, error: BaseException) -> None:
        """Every request in flight ends with ``error``."""
        with self._lock:
            rids = set(self._streams) | set(self.output_processor.requests)
            for rid in rids:
                self.output_processor.remove(rid)
        for rid in rids:
            self._deliver(rid, error)

    def _deliver(self, rid: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            try:
                target[0].call_soon_threadsafe(target[1].put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass
