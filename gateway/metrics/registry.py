"""Prometheus metrics: engine gauges, per-tenant counters, per-model latency histograms.

The latency histograms live in :mod:`gateway.metrics.latency`; every series: ``docs/metrics.md``.

Each app has its own ``CollectorRegistry`` (several apps can live in one test process). Engine
figures (KV blocks, prefix-cache tokens, queue lengths, LoRA slots) come from
``EngineClient.stats()`` when ``/metrics`` is scraped, so the engine thread never touches
prometheus objects. Tenants are labelled by id, never by key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.gateway.metrics.latency import LatencyMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Reads ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        gauges = (
            ("loraplex_kv_blocks_total", "KV cache blocks in the pool", "kv_blocks_total"),
            (
                "loraplex_kv_cache_bytes",
                "Bytes of the KV pool, K and V of every layer (docs/kv_sizing.md)",
                "kv_cache_bytes",
            ),
            ("loraplex_kv_blocks_in_use", "KV cache blocks referenced", "kv_blocks_in_use"),
            ("loraplex_requests_running", "Requests in the running batch", "requests_running"),
            ("loraplex_requests_waiting", "Requests waiting to be scheduled", "requests_waiting"),
            ("loraplex_lora_slots_in_use", "Device LoRA slots held", "lora_slots_in_use"),
        )
        for name, doc, key in gauges:
            yield GaugeMetricFamily(name, doc, value=float(s.get(key, 0)))
        queried = float(s.get("prefix_cache_queried_tokens", 0))
        hit = float(s.get("prefix_cache_hit_tokens", 0))
        yield CounterMetricFamily(
            "loraplex_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=queried,
        )
        yield CounterMetricFamily(
            "loraplex_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            value=hit,
        )
        yield GaugeMetricFamily(
            "loraplex_prefix_cache_hit_rate",
            "Hit tokens over queried tokens since start",
            value=hit / queried if queried else 0.0,
        )
        yield from _spec_decode_counters(s)
        yield from _kv_tier_series(s)
        yield from _replica_series(s)
        yield from _hardening_series(s)


def _hardening_series(s: dict[str, Any]) -> Iterator[Any]:
    """The grammar sandbox and the query-of-death quarantine (docs/hardening.md)."""
    yield GaugeMetricFamily(
        "loraplex_requests_waiting_for_grammar",
        "Requests whose structured-output grammar is being vetted or compiled",
        value=float(s.get("requests_waiting_for_grammar", 0)),
    )
    counters = (
        ("grammar_vetted", "Grammars compiled in the sandbox (cache misses), refused or not"),
        ("grammar_refused", "Grammars the sandbox refused (error, no token, crash, time, memory)"),
        ("grammar_worker_deaths", "Sandbox workers killed by a grammar (crash, time limit)"),
        ("grammar_compiled", "Grammars compiled by the engine core after the sandbox"),
        ("engine_core_deaths", "Engine core processes that died (and were restarted)"),
        ("quarantine_refusals", "Requests refused as queries of death or throttled tenants'"),
    )
    for key, doc in counters:
        yield CounterMetricFamily(f"loraplex_{key}", doc, value=float(s.get(key, 0)))


_KV_TIER_COUNTERS = (
    ("hits", "Blocks a KV tier returned"),
    ("misses", "KV tier reads that found no block (absent, corrupt, or the store failing)"),
    ("stores", "Blocks written to a KV tier"),
    ("evictions", "Blocks a KV tier evicted to stay within its size"),
    ("corrupt", "KV tier records found corrupt or truncated (dropped, recomputed)"),
    ("errors", "KV tier calls that failed (I/O errors, a shared store down or slow)"),
    ("bytes_read", "Payload bytes read from a KV tier"),
    ("bytes_written", "Bytes written to a KV tier"),
    ("loaded_blocks", "Blocks loaded from a KV tier into the pool"),
    ("load_seconds", "Seconds spent reading blocks from a KV tier for loads"),
)


def _kv_tier_series(s: dict[str, Any]) -> Iterator[Any]:
    """The KV tiers below the pool (docs/kv_tiers.md): per tier, and the connector's totals."""
    tiers = sorted(
        {
            k[len("kv_tier_") : -len("_capacity_bytes")]
            for k in s
            if k.startswith("kv_tier_") and k.endswith("_capacity_bytes")
        }
    )
    if not tiers:
        return
    for key, doc in _KV_TIER_COUNTERS:
        family = CounterMetricFamily(f"loraplex_kv_tier_{key}", doc, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier], float(s.get(f"kv_tier_{tier}_{key}", 0)))
        yield family
    for key, doc in (
        ("used_bytes", "Bytes a KV tier holds"),
        ("capacity_bytes", "A KV tier's size"),
    ):
        family = GaugeMetricFamily(f"loraplex_kv_tier_{key}", doc, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier], float(s.get(f"kv_tier_{tier}_{key}", 0)))
        yield family
    for key, doc in (
        ("loads", "Requests that waited for blocks from a KV tier"),
        ("loads_fallen_back", "KV tier loads given up (the request recomputed)"),
        ("offloaded_blocks", "Blocks copied out of the pool into the KV tiers"),
        ("store_dropped", "KV tier writes dropped because the write queue was full"),
    ):
        yield CounterMetricFamily(
            f"loraplex_kv_tier_{key}", doc, value=float(s.get(f"kv_tier_{key}", 0))
        )
    yield CounterMetricFamily(
        "loraplex_kv_tier_load_wait_seconds",
        "Seconds requests waited for their KV tier loads (sum)",
        value=float(s.get("kv_tier_load_seconds", 0)),
    )
    yield GaugeMetricFamily(
        "loraplex_requests_waiting_for_kv",
        "Requests waiting for blocks from a KV tier",
        value=float(s.get("requests_waiting_for_kv", 0)),
    )


def _replica_series(s: dict[str, Any]) -> Iterator[Any]:
    """With engine replicas (``--replicas``): how many run, and requests routed to each."""
    if "replicas" not in s:
        return
    yield GaugeMetricFamily("loraplex_replicas", "Engine replicas", value=float(s["replicas"]))
    yield GaugeMetricFamily(
        "loraplex_replicas_running",
        "Engine replicas running (the others are restarting or gone)",
        value=float(s.get("replicas_running", 0)),
    )
    routed = CounterMetricFamily(
        "loraplex_router_requests",
        "Generation requests the router sent to each replica",
        labels=["replica"],
    )
    for name, count in sorted((s.get("routed") or {}).items()):
        routed.add_metric([name], float(count))
    yield routed


def _spec_decode_counters(s: dict[str, Any]) -> Iterator[Any]:
    """Speculative decoding's acceptance counters, under vLLM's ``spec_decode_*`` names."""
    for key, doc in (
        ("spec_decode_num_drafts", "Verifications of a sequence's proposals"),
        ("spec_decode_num_draft_tokens", "Proposed tokens verified"),
        ("spec_decode_num_accepted_tokens", "Proposed tokens accepted"),
    ):
        yield CounterMetricFamily(f"loraplex_{key}", doc, value=float(s.get(key, 0)))
    per_pos = CounterMetricFamily(
        "loraplex_spec_decode_num_accepted_tokens_per_pos",
        "Proposed tokens accepted, by position in the proposal (0 = first)",
        labels=["position"],
    )
    for position, count in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos") or []):
        per_pos.add_metric([str(position)], float(count))
    yield per_pos


class _SharedLimiterCollector(Collector):
    """The shared rate limiter's fallback count, read at scrape time."""

    def __init__(self, limiter: Any) -> None:
        self._limiter = limiter

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(
            "loraplex_rate_limit_fallback_admissions",
            "Requests this gateway's own limiter admitted because the shared one's Redis failed",
            value=float(self._limiter.fallback_admissions),
        )


class GatewayMetrics:
    """The app's registry and its counters.

    Args:
        stats: The engine's ``stats()``.
        base_model: The served model's name (the base model's ``model_name`` label).
        max_adapter_labels: Adapters that may get a ``model_name`` label of their own
            (:class:`gateway.metrics.latency.LatencyMetrics`).

    Attributes:
        latency: The per-model latency histograms.
    """

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        base_model: str,
        max_adapter_labels: int = 32,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.latency = LatencyMetrics(base_model, max_adapter_labels)
        self.registry.register(self.latency)
        self.requests = Counter(
            "loraplex_tenant_requests",
            "Chat requests by tenant, model kind and status",
            ["tenant", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "loraplex_tenant_tokens",
            "Tokens by tenant and kind (prompt, completion, cached)",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "loraplex_rate_limited_requests",
            "Requests refused with 429, by tenant and limit",
            ["tenant", "limit"],
            registry=self.registry,
        )
        self._tenant_tokens: dict[str, tuple[Any, Any, Any]] = {}

    def record_request(
        self,
        tenant_id: str,
        status: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
    ) -> None:
        """Count one finished request (any status); its latencies go to :attr:`latency`."""
        self.requests.labels(tenant_id, status).inc()
        prompt, completion, cached = self._token_counters(tenant_id)
        prompt.inc(prompt_tokens)
        completion.inc(completion_tokens)
        cached.inc(cached_tokens)

    def _token_counters(self, tenant_id: str) -> tuple[Any, Any, Any]:
        """The tenant's prompt / completion / cached token counters (label lookups cached)."""
        found = self._tenant_tokens.get(tenant_id)
        if found is None:
            found = tuple(
                self.tokens.labels(tenant_id, k) for k in ("prompt", "completion", "cached")
            )
            self._tenant_tokens[tenant_id] = found
        return found

    def watch_limiter(self, limiter: Any) -> None:
        """Export the shared rate limiter's fallback admissions (nothing for the in-process one)."""
        if hasattr(limiter, "fallback_admissions"):
            self.registry.register(_SharedLimiterCollector(limiter))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
