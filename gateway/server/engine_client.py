"""What the gateway needs from an engine, and its implementation over :class:`AsyncLLM`.

Routes talk to an :class:`EngineClient`, never to the engine's internals, so the gateway
benchmark can put an instant fake engine behind the real app (``bench/gateway.py``) and tests can
share one engine between apps. Input processing (chat template, image decoding) is CPU work: it
runs on worker threads shared round-robin between tenants (``gateway.server.fair_pool``), never
on the event loop, so no tenant's inputs queue another's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.adapters.registry import AdapterLimits
from loraplex.engine.inputs import ProcessedPrompt
from loraplex.engine.processing import max_token_bytes
from loraplex.engine.request import EngineRequest, RequestOutput
from loraplex.engine.sampling.logprobs import TokenBytes
from loraplex.engine.tool_call_format import detect_tool_call_format
from loraplex.gateway.server.fair_pool import FairWorkerPool, default_workers


@dataclass(frozen=True)
class InputLimits:
    """What the gateway checks before it asks the engine to process a prompt.

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


class EngineClient(Protocol):
    """The engine as the gateway sees it.

    Attributes:
        model_name: The served base model's name.
        max_model_len: Most tokens (prompt + completion) of one sequence.
        adapter_limits: What uploaded adapters must fit.
        input_limits: Cheap bounds on a prompt, checked before it is processed.
    """

    model_name: str
    max_model_len: int
    adapter_limits: AdapterLimits
    input_limits: InputLimits

    @property
    def is_running(self) -> bool:
        """True while the engine can take requests."""
        ...

    async def process(
        self, messages: Any, *, tenant: str = "", tools: list[dict] | None = None
    ) -> ProcessedPrompt:
        """Chat messages (and tools, for the template) to prompt token ids and images.

        Runs on a worker shared fairly by tenants.

        Raises:
            ValueError: bad messages or images (``InvalidImageError`` is one).
            PoolBusyError: the tenant has too many prompts waiting to be processed.
        """
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one is finished.

        Raises:
            ValueError: the engine refused the request.
            EngineDeadError: the engine is not running.
        """
        ...

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's exact UTF-8 bytes (OpenAI logprobs' ``bytes`` and ``token``)."""
        ...

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = True, tenant: str = ""
    ) -> list[int]:
        """``text``'s token ids (the model's tokenizer), on the tenants' shared workers.

        Raises:
            PoolBusyError: the tenant has too many jobs waiting.
        """
        ...

    async def detokenize(self, token_ids: list[int], *, tenant: str = "") -> str:
        """The text of ``token_ids`` (special tokens kept), on the tenants' shared workers.

        Raises:
            ValueError: an id outside the vocabulary.
            PoolBusyError: the tenant has too many jobs waiting.
        """
        ...

    async def add_lora(self, adapter: Any) -> None:
        """Make a validated adapter available by its digest."""
        ...

    async def remove_lora(self, digest: str) -> bool:
        """Drop an adapter from memory; False while a running request uses it."""
        ...

    def stats(self) -> dict[str, Any]:
        """Scheduler and cache figures (``AsyncLLM.stats`` keys)."""
        ...

    def drain_kv_events(self) -> list[Any]:
        """The engine's KV events since the last call (``engine.kv_events``), for a router."""
        ...

    def shutdown(self) -> None:
        """Abort everything and stop."""
        ...


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


class LocalEngineClient:
    """:class:`EngineClient` over an in-process :class:`engine.async_llm.AsyncLLM`.

    Args:
        llm: The running engine.
        model_name: Name of the base model in the API.
    """

    def __init__(self, llm: Any, model_name: str) -> None:
        engine = llm.engine
        self.llm = llm
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.adapter_limits = engine.adapter_limits
        self.kv_pool = engine.kv_sizing  # how the pool was sized (serve prints it)
        self._inputs = engine.inputs
        self._token_bytes = TokenBytes(engine.tokenizer)
        self._tokenizer = engine.tokenizer
        self.input_limits = InputLimits(
            max_token_bytes=max_token_bytes(engine.tokenizer),
            image_tokens=getattr(engine.model, "num_image_tokens", 0),
            max_images=engine.inputs.max_images,
            tool_call_format=detect_tool_call_format(engine.inputs.chat_template),
            vocab_size=engine.model.vocab_size,
        )
        self._workers = FairWorkerPool(default_workers())

    def describe(self) -> dict[str, Any]:
        """What was loaded: ``num_parameters``, ``dtype``, ``device``, ``kv_pool``."""
        engine = self.llm.engine
        return {
            "num_parameters": sum(p.numel() for p in engine.model.parameters()),
            "dtype": str(engine.config.dtype).removeprefix("torch."),
            "device": str(engine.config.device),
            "kv_pool": engine.kv_sizing.describe(),
        }

    @property
    def is_running(self) -> bool:
        """See :class:`EngineClient`."""
        return self.llm.is_running

    async def process(
        self, messages: Any, *, tenant: str = "", tools: list[dict] | None = None
    ) -> ProcessedPrompt:
        """See :class:`EngineClient`."""
        return await self._workers.run(tenant, self._inputs, messages, tools)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """See :class:`EngineClient`."""
        return self.llm.generate(request)

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
        """See :class:`EngineClient`."""
        await self.llm.add_lora(adapter)

    async def remove_lora(self, digest: str) -> bool:
        """See :class:`EngineClient`."""
        return await self.llm.remove_lora(digest)

    def stats(self) -> dict[str, Any]:
        """See :class:`EngineClient`."""
        return dict(self.llm.stats())

    def drain_kv_events(self) -> list[Any]:
        """See :class:`EngineClient`."""
        return self.llm.drain_kv_events()

    def shutdown(self) -> None:
        """See :class:`EngineClient` (the engine's grammar sandbox stops too)."""
        self.llm.shutdown()
        self.llm.engine.shutdown()
        self._workers.shutdown()
