"""What the gateway needs from an engine: the type of the front it serves.

Routes talk to an :class:`EngineClient`, never to the engine's internals, so the gateway
benchmark can put an instant fake engine behind the real app (``bench/gateway.py``) and tests can
share one engine between apps. The one implementation is the engine's front,
``engine.client.front.AsyncLLM`` (``gateway.server.build.start_engine`` builds it over a core on
a thread, in a process, as Ray actors, or a router over several): input processing (chat
template, image decoding) runs there on worker threads shared round-robin between tenants
(``engine.client.fair_pool``), never on the event loop, so no tenant's inputs queue another's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from loraplex.adapters.limits import AdapterLimits
from loraplex.engine.client.front import InputLimits
from loraplex.engine.client.inputs import ProcessedPrompt
from loraplex.engine.request import EngineRequest, RequestOutput

__all__ = ["EngineClient", "InputLimits"]


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
        """Scheduler and cache figures (``EngineCore.stats`` keys)."""
        ...

    def drain_kv_events(self) -> list[Any]:
        """The engine's KV events since the last call (``engine.kv_cache.events``), for a router."""
        ...

    def shutdown(self) -> None:
        """Abort everything and stop."""
        ...
