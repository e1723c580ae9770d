""":class:`EngineClient` over an engine core in its own process (``engine.core_client``).

The gateway's process keeps tokenization, chat templates and image processing (on the fair
worker pool, as the in-process client does) and detokenization; the core process only
schedules and steps the model. So no tokenization, SSE chunk or usage write competes with a
model step for one GIL, and a fault in the core is not a fault of the gateway: the client
restarts it (see ``engine.core_client``) while ``/health`` answers 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from loraplex.engine.core_client import CoreProcessClient
from loraplex.engine.inputs import ProcessedPrompt
from loraplex.engine.processing import load_processor, max_token_bytes
from loraplex.engine.request import EngineRequest, RequestOutput
from loraplex.engine.sampling.logprobs import TokenBytes
from loraplex.engine.tool_call_format import detect_tool_call_format
from loraplex.gateway.server.engine_client import InputLimits, decode, encode
from loraplex.gateway.server.fair_pool import FairWorkerPool, default_workers


class ProcessEngineClient:
    """:class:`gateway.server.engine_client.EngineClient` over a core process.

    Args:
        config: The ``EngineConfig``.
        store_root: The adapter store the core reads adapters from.
        model_name: Name of the base model in the API.
        launcher: Where the core runs (``engine.core_launch``; a child process by default).
        quarantine: The deaths and quarantined requests shared with the other replicas and
            gateways (``engine.quarantine``); a new one in memory when None.

    Raises:
        RuntimeError: the core exited or timed out before it was ready.
        ValueError: the model directory has no usable tokenizer or processor.
    """

    def __init__(
        self,
        config: Any,
        store_root: str,
        model_name: str,
        launcher: Any = None,
        quarantine: Any = None,
    ) -> None:
        self.model_name = model_name
        self.core: CoreProcessClient | None = None
        core = CoreProcessClient(config, store_root, launcher=launcher, quarantine=quarantine)
        info = core.start()
        self.core = core
        try:
            shape = SimpleNamespace(
                image_token_id=info.image_token_id, num_image_tokens=info.num_image_tokens
            )
            tokenizer, self._inputs = load_processor(
                config.model,
                shape,
                config.mm_hash,
                max_images=config.max_images,
                max_image_pixels=config.max_image_pixels,
                max_image_aspect_ratio=config.max_image_aspect_ratio,
                max_request_image_pixels=config.max_request_image_pixels,
            )
            core.set_tokenizer(tokenizer)
        except BaseException:
            core.shutdown()
            raise
        self.info = info
        self.max_model_len = info.max_model_len
        self.adapter_limits = info.adapter_limits
        self._token_bytes = TokenBytes(tokenizer)
        self._tokenizer = tokenizer
        self.input_limits = InputLimits(
            max_token_bytes=max_token_bytes(tokenizer),
            image_tokens=info.num_image_tokens,
            max_images=self._inputs.max_images,
            tool_call_format=detect_tool_call_format(self._inputs.chat_template),
            vocab_size=info.vocab_size,
        )
        self._workers = FairWorkerPool(default_workers())

    def describe(self) -> dict[str, Any]:
        """What was loaded: ``num_parameters``, ``dtype``, ``device``, ``kv_pool``, ``pid``."""
        info = self.core.info
        return {
            "num_parameters": info.num_parameters,
            "dtype": info.dtype,
            "device": info.device,
            "kv_pool": info.kv_pool,
            "pid": info.pid,
        }

    @property
    def is_running(self) -> bool:
        """See :class:`EngineClient`: False while the core restarts."""
        return self.core is not None and self.core.is_running

    @property
    def recovering(self) -> bool:
        """The core died and a new one is starting (the gateway waits instead of exiting)."""
        return self.core is not None and self.core.recovering

    async def process(
        self, messages: Any, *, tenant: str = "", tools: list[dict] | None = None
    ) -> ProcessedPrompt:
        """See :class:`EngineClient`."""
        return await self._workers.run(tenant, self._inputs, messages, tools)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """See :class:`EngineClient`."""
        return self.core.generate(request)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """See :class:`EngineClient`."""
        return self._token_bytes(token_ids)

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = True, tenant: str = ""
    ) -> list[int]:
        """See :class:`EngineClient`."""
        return await self._workers.run(tenant, encode, self._tokenizer, text, add_special_tokens)

    async def detokenize(self, token_ids: list[int], *, tenant: str = "") -> str:
        """See :class:`EngineClient`."""
        return await self._workers.run(tenant, decode, self._tokenizer, token_ids)

    async def add_lora(self, adapter: Any) -> None:
        """See :class:`EngineClient`: the core reads the adapter from the store by digest."""
        await self.core.add_lora(adapter.digest)

    async def remove_lora(self, digest: str) -> bool:
        """See :class:`EngineClient`."""
        return await self.core.remove_lora(digest)

    def stats(self) -> dict[str, Any]:
        """See :class:`EngineClient`."""
        return self.core.stats()

    def drain_kv_events(self) -> list[Any]:
        """See :class:`EngineClient`."""
        return self.core.drain_kv_events()

    def shutdown(self) -> None:
        """See :class:`EngineClient`."""
        self.core.shutdown()
        self._workers.shutdown()
