"""A router over several core clients of one model, itself an :class:`EngineCoreClient`.

The front (``engine.client.front.AsyncLLM``) processes each prompt once, whether there are 1 or
N replicas, and computes its block hashes once; this client only picks a core. For each
request it:

1. brings the router's views up to date: each replica's KV events since the last request
   (``engine.kv_cache.events``) and its health (a replica that is not running leaves the routing
   table at once and rejoins, with an empty view, when it runs again);
2. asks the router (``engine.client.router``) for a replica with the request's block hashes
   (the engines' own: tokens, adapter, images, the tenant's cache salt) and adapter, and counts
   its tokens (prompt + ``n * max_tokens``) as queued there until the front releases it.

Adapters are added to and removed from every running replica. A request whose replica dies
ends as it does with one core (``EngineDeadError``: 503 and an ``aborted`` usage row); the next
request goes to the others. With no replica running, ``add_request`` raises
``EngineDeadError`` too. The router and its views live here, beside the client that uses them,
because they are the core client's business: the gateway sees one front and never a replica.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from loraplex.engine.client.core_client import EngineCoreClient, FinishRequest, OutputSink
from loraplex.engine.client.router import NoReplicaError, Router, RoutingPolicy
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.request import EngineRequest


class _ReplicaSink:
    """One replica's sink: passes its outputs on, and fails only its own requests on death."""

    def __init__(self, router: ReplicaRouter, name: str) -> None:
        self.router, self.name = router, name

    def on_outputs(self, outputs: list) -> None:
        self.router._sink.on_outputs(outputs)

    def on_error(self, request_id: str, error: BaseException) -> None:
        self.router._sink.on_error(request_id, error)

    def on_dead(self, error: BaseException) -> None:
        for rid in self.router._requests_on(self.name):
            self.router._sink.on_error(rid, error)


def tier_capacity_blocks(stats: dict[str, Any]) -> int:
    """Blocks a replica's own KV tiers hold (host + disk bytes over a block's), from its stats."""
    blocks, pool = stats.get("kv_blocks_total", 0), stats.get("kv_cache_bytes", 0)
    tiers = stats.get("kv_tier_host_capacity_bytes", 0) + stats.get(
        "kv_tier_disk_capacity_bytes", 0
    )
    if not blocks or not pool or not tiers:
        return 0
    return int(tiers // (pool / blocks))


class ReplicaRouter(EngineCoreClient):
    """Several core clients of the same model behind one, with a router.

    Args:
        replicas: ``name -> EngineCoreClient``, in order (started).
        policy: The router's policy; its ``block_size`` must be the engines'.

    Attributes:
        wants_block_hashes: True when the policy reads block hashes (``"cache"`` and more
            than one replica): the front computes them then.
        num_routed: Requests sent to each replica, by name.

    Raises:
        ValueError: no replica.
    """

    def __init__(self, replicas: dict[str, EngineCoreClient], policy: RoutingPolicy) -> None:
        if not replicas:
            raise ValueError("need one or more replicas")
        self.replicas = dict(replicas)
        self.router = Router(list(self.replicas), policy)
        self._first = next(iter(self.replicas.values()))
        self.info = self._first.info
        self.wants_block_hashes = policy.policy == "cache" and len(self.replicas) > 1
        self.num_routed: dict[str, int] = dict.fromkeys(self.replicas, 0)
        self._sink: OutputSink | None = None
        self._lock = threading.Lock()
        self._routed: dict[str, tuple[str, int]] = {}  # request id -> (replica, tokens)

    def set_sink(self, sink: OutputSink) -> None:
        """See :class:`EngineCoreClient`."""
        self._sink = sink
        for name, replica in self.replicas.items():
            replica.set_sink(_ReplicaSink(self, name))

    def _requests_on(self, name: str) -> list[str]:
        with self._lock:
            return [rid for rid, (n, _) in self._routed.items() if n == name]

    # ------------------------------------------------------------------------- routing
    def refresh(self) -> None:
        """Apply every replica's pending KV events and health to the router."""
        for name, replica in self.replicas.items():
            view = self.router.views[name]
            running = replica.is_running
            if running != view.healthy:
                self.router.set_healthy(name, running)
            if running and view.tier_capacity_blocks is None:
                view.tier_capacity_blocks = tier_capacity_blocks(replica.stats())
            events = replica.drain_kv_events()
            if running:
                view.apply(events)

    def route(self, block_hashes: Sequence[bytes], adapter: str | None = None) -> str:
        """The replica a request goes to (views refreshed first).

        Raises:
            EngineDeadError: no replica is running.
        """
        self.refresh()
        try:
            return self.router.choose(block_hashes, adapter)
        except NoReplicaError as exc:
            raise EngineDeadError(str(exc)) from None

    def add_request(self, request: EngineRequest, block_hashes: Sequence[bytes] = ()) -> None:
        """See :class:`EngineCoreClient`: to the replica the router chooses."""
        name = self.route(block_hashes, request.lora_digest)
        sampling = request.sampling
        tokens = len(request.prompt_token_ids) + sampling.n * sampling.max_tokens
        with self._lock:
            self._routed[request.request_id] = (name, tokens)
        self.router.started(name, tokens)
        try:
            self.replicas[name].add_request(request)
        except BaseException:
            self.release(request.request_id)
            raise
        self.num_routed[name] += 1

    def _replica_of(self, request_id: str) -> EngineCoreClient | None:
        with self._lock:
            routed = self._routed.get(request_id)
        return None if routed is None else self.replicas[routed[0]]

    def abort(self, request_id: str) -> None:
        """See :class:`EngineCoreClient`."""
        replica = self._replica_of(request_id)
        if replica is not None:
            replica.abort(request_id)

    def finish_requests(self, finishes: list[FinishRequest]) -> None:
        """See :class:`EngineCoreClient`: each to its request's replica."""
        for f in finishes:
            replica = self._replica_of(f.request_id)
            if replica is not None:
                replica.finish_requests([f])

    def release(self, request_id: str) -> None:
        """The request's tokens are no longer queued on its replica."""
        with self._lock:
            routed = self._routed.pop(request_id, None)
        if routed is not None:
            self.router.finished(*routed)
            self.replicas[routed[0]].release(request_id)

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
        return not self.is_running and any(r.recovering for r in self.replicas.values())

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
        each replica, by name). Lists (per-position counters) are added element by element.
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
        """None: the router consumes its replicas' events itself."""
        return []

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica."""
        for replica in self.replicas.values():
            replica.shutdown(timeout)
