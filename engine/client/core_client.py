"""The interface between the front and an engine core (vLLM v1's ``EngineCoreClient``).

A core client is transport and liveness only. It deals in token ids: it takes an
:class:`~engine.request.EngineRequest` whose prompt is already processed, and hands the core's
:class:`~engine.scheduling.output.EngineCoreOutput` batches to the one :class:`OutputSink` the
front (``engine.client.front.AsyncLLM``) gave it. It never tokenizes, detokenizes, or keeps a
per-request stream. Three kinds implement it:

- ``engine.client.inproc.InprocCoreClient``: the core on a thread of this process;
- ``engine.client.process.ProcessCoreClient``: the core in a child process or a Ray actor,
  over ZMQ, restarted when it dies (docs/hardening.md);
- ``engine.client.replicas.ReplicaRouter``: N core clients behind a router, itself one.

Threads: the sink's methods are called from the core client's own thread (the engine thread,
the ZMQ reader); the other methods from the front's event loop or any thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

from loraplex.engine.core.wire import CoreInfo, FinishRequest
from loraplex.engine.request import EngineRequest
from loraplex.engine.scheduling.output import EngineCoreOutput

__all__ = ["CoreInfo", "EngineCoreClient", "FinishRequest", "OutputSink", "core_info"]


class OutputSink(Protocol):
    """Where a core client delivers what its core says (the front implements it)."""

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's (or several steps') outputs, in the order the core produced them."""
        ...

    def on_error(self, request_id: str, error: BaseException) -> None:
        """One request ends with ``error`` (refused after it was sent, or its core died).

        ``ValueError`` (``StructuredOutputError`` for a grammar the core refused),
        ``RequestFailedError`` (a fault admitting it) or ``EngineDeadError``.
        """
        ...

    def on_dead(self, error: BaseException) -> None:
        """Every request this client has in flight ends with ``error`` (its core died)."""
        ...


class EngineCoreClient(ABC):
    """One engine core (or a set of them) as the front sees it.

    Attributes:
        info: The core's model and pool (``engine.core.wire.CoreInfo``), set once started.
        wants_block_hashes: Whether ``add_request`` reads the request's block hashes (a
            router does); the front computes them only then.
    """

    info: CoreInfo | None = None
    wants_block_hashes: bool = False

    @abstractmethod
    def set_sink(self, sink: OutputSink) -> None:
        """Where outputs go from now on (the front sets it once, before any request)."""

    @abstractmethod
    def add_request(self, request: EngineRequest, block_hashes: Sequence[bytes] = ()) -> None:
        """Send a processed request to the core; its outputs come to the sink.

        Args:
            request: The request, its prompt in token ids.
            block_hashes: The prompt's block hashes, computed once by the front; only a
                router reads them (prefix-aware routing).

        Raises:
            EngineDeadError: no core is running.
            ValueError: refused before it was sent (``QueryOfDeathError``).
            RuntimeError: refused before it was sent (``TenantThrottledError``).
        """

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request in the core (its blocks are freed at the next step boundary)."""

    @abstractmethod
    def finish_requests(self, finishes: list[FinishRequest]) -> None:
        """Finishes the front found (stop strings, detokenization faults): the core stops them."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional, most keep no books
        """The front is done with a request, whichever way it ended (bookkeeping only)."""

    @abstractmethod
    async def add_lora(self, adapter: Any) -> None:
        """Load an adapter (a ``LoraAdapter``, or a digest the core reads from its store).

        Raises:
            RuntimeError: the core could not load it.
            EngineDeadError: no core is running.
        """

    @abstractmethod
    async def remove_lora(self, digest: str) -> bool:
        """Drop an adapter; False (nothing changes) while a running request uses it."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """The core's scheduler and cache figures (``EngineCore.stats`` keys)."""

    @abstractmethod
    def drain_kv_events(self) -> list[Any]:
        """The core's KV events since the last call, oldest first (``engine.kv_cache.events``)."""

    def describe(self) -> dict[str, Any]:
        """What was loaded and where it runs.

        ``num_parameters``, ``dtype``, ``device``, ``kv_pool``, ``pid``, ``cpu_threads``
        (torch's threads and their CPUs, one line).
        """
        info = self.info
        return {
            "num_parameters": info.num_parameters,
            "dtype": info.dtype,
            "device": info.device,
            "kv_pool": info.kv_pool,
            "pid": info.pid,
            "cpu_threads": info.cpu_threads,
        }

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """True while the core can take requests."""

    @property
    def recovering(self) -> bool:
        """True while no core runs but one is being restarted (wait, do not exit)."""
        return False

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core; requests in flight end with ``EngineDeadError`` (``on_dead``)."""


def core_info(core: Any) -> CoreInfo:
    """The :class:`CoreInfo` of an ``EngineCore`` (in this process or the core's own)."""
    import os

    model = core.model
    return CoreInfo(
        max_model_len=core.max_model_len,
        adapter_limits=core.adapter_limits,
        image_token_id=getattr(model, "image_token_id", None),
        num_image_tokens=getattr(model, "num_image_tokens", 0),
        num_parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(core.dtype).removeprefix("torch."),
        device=str(core.device),
        kv_pool=core.kv_sizing.describe(),
        pid=os.getpid(),
        vocab_size=model.vocab_size,
        cpu_threads=getattr(core, "cpu_threads", ""),
    )
