"""An :class:`EngineClient` over several replicas of one model, routing each request.

The gateway talks to it as to one engine. Prompt processing (chat template, tokenizer, image
processor) and detokenization happen once, on the first replica's client (every replica serves
the same model directory). For each generation request the set:

1. brings the router's views up to date: each replica's KV events since the last request
   (``engine.kv_events``) and its health (a replica that is not running leaves the routing
   table at once and rejoins, with an empty view, when it runs again);
2. computes the request's block hashes as the engines do (``EngineRequest.block_hasher``:
   tokens, adapter, images, the tenant's cache salt);
3. asks the router (``gateway.routing.router``) for a replica, and counts the request's
   tokens (prompt + ``n * max_tokens``) as queued on it until its stream ends, whichever way.

Adapters are added to and removed from every running replica. A request whose replica dies
ends as it does with one engine (``EngineDeadError``: 503 and an ``aborted`` usage row); the
next request goes to the others. With no replica running, ``generate`` raises
``EngineDeadError`` too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from loraplex.engine.async_llm import EngineDeadError
from loraplex.engine.request import EngineRequest, RequestOutput
from loraplex.gateway.routing.router import NoReplicaError, Router, RoutingPolicy


class ReplicaSetClient:
    """Several engine clients of the same model behind one, with a router.

    Args:
        replicas: ``name -> EngineClient``, in order (the first does prompt processing).
        policy: The router's policy; its ``block_size`` must be the engines'.
        prefix_hash: The engines' block hash algorithm (``--prefix-hash``).

    Raises:
        ValueError: no replica.
    """

    def __init__(
        self,
        replicas: dict[str, Any],
        policy: RoutingPolicy,
        *,
        prefix_hash: str = "sha256",
    ) -> None:
        if not replicas:
            raise ValueError("need one or more replicas")
        self.replicas = dict(replicas)
        self.router = Router(list(self.replicas), policy)
        self.prefix_hash = prefix_hash
        first = next(iter(self.replicas.values()))
        self._first = first
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.adapter_limits = first.adapter_limits
        self.input_limits = first.input_limits
        self.num_routed: dict[str, int] = dict.fromkeys(self.replicas, 0)

    # ------------------------------------------------------------------------- routing
    def refresh(self) -> None:
        """Apply every replica's pending KV events and health to the router."""
        for name, replica in self.replicas.items():
            view = self.router.views[name]
            running = replica.is_running
            if running != view.healthy:
                self.router.set_healthy(name, running)
            events = replica.drain_kv_events()
            if running:
                view.apply(events)

    def route(self, request: EngineRequest) -> str:
        """The replica ``request`` goes to (views refreshed first).

        Raises:
            EngineDeadError: no replica is running.
        """
        self.refresh()
        policy = self.router.policy
        hashes = (  # only the cache-aware policy reads them; hashing a long prompt costs
            request.block_hasher(policy.block_size, self.prefix_hash).block_hashes
            if policy.policy == "cache" and len(self.replicas) > 1
            else []
        )
        try:
            return self.router.choose(hashes, request.lora_digest)
        except NoReplicaError as exc:
            raise EngineDeadError(str(exc)) from None

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """See :class:`EngineClient`: the request runs on the replica the router chooses."""
        return self._generate(request)

    async def _generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        name = self.route(request)
        sampling = request.sampling
        tokens = len(request.prompt_token_ids) + sampling.n * sampling.max_tokens
        self.router.started(name, tokens)
        self.num_routed[name] += 1
        try:
            async for out in self.replicas[name].generate(request):
                yield out
        finally:
            self.router.finished(name, tokens)

    # ----------------------------------------------------------------- the same model
    def describe(self) -> dict[str, Any]:
        """The first replica's description, with how many replicas there are."""
        return {**self._first.describe(), "replicas": len(self.replicas)}

    @property
    def is_running(self) -> bool:
        """True while any replica runs."""
        return any(r.is_running for r in self.replicas.values())

    @property
    def recovering(self) -> bool:
        """No replica runs, and one is restarting."""
        return not self.is_running and any(
            getattr(r, "recovering", False) for r in self.replicas.values()
        )

    async def process(self, messages: Any, *, tenant: str = "", tools: Any = None) -> Any:
        """See :class:`EngineClient` (on the first replica's client: the same model)."""
        return await self._first.process(messages, tenant=tenant, tools=tools)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """See :class:`EngineClient`."""
        return self._first.token_bytes(token_ids)

    async def tokenize(
        self, text: str, *, add_special_tokens: bool = True, tenant: str = ""
    ) -> list[int]:
        """See :class:`EngineClient`."""
        return await self._first.tokenize(
            text, add_special_tokens=add_special_tokens, tenant=tenant
        )

    async def detokenize(self, token_ids: list[int], *, tenant: str = "") -> str:
        """See :class:`EngineClient`."""
        return await self._first.detokenize(token_ids, tenant=tenant)

    async def add_lora(self, adapter: Any) -> None:
        """Add the adapter to every running replica."""
        running = [r for r in self.replicas.values() if r.is_running]
        await asyncio.gather(*(r.add_lora(adapter) for r in running))

    async def remove_lora(self, digest: str) -> bool:
        """Remove it from every running replica; False if one still uses it."""
        running = [r for r in self.replicas.values() if r.is_running]
        results = await asyncio.gather(*(r.remove_lora(digest) for r in running))
        return all(results)

    def stats(self) -> dict[str, Any]:
        """Every replica's figures added up, with the set's own.

        The set adds ``replicas``, ``replicas_running`` and ``routed`` (requests sent to
        each replica, by name).

        Lists (per-position counters) are added element by element.
        """
        total: dict[str, Any] = {}
        for replica in self.replicas.values():
            for key, value in replica.stats().items():
                if isinstance(value, list):
                    have = total.setdefault(key, [])
                    have.extend([0] * (len(value) - len(have)))
                    for i, v in enumerate(value):
                        have[i] += v
                elif isinstance(value, int | float):
                    total[key] = total.get(key, 0) + value
        total["replicas"] = len(self.replicas)
        total["replicas_running"] = sum(r.is_running for r in self.replicas.values())
        total["routed"] = dict(self.num_routed)
        return total

    def drain_kv_events(self) -> list[Any]:
        """None: the set's own router consumes its replicas' events."""
        return []

    def shutdown(self) -> None:
        """Stop every replica."""
        for replica in self.replicas.values():
            replica.shutdown()
