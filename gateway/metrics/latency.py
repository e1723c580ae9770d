"""Per-model latency histograms: time to first token, inter-token, end-to-end and queue time.

The names are vLLM's (``vllm:time_to_first_token_seconds`` and so on) with our prefix, and so
are the buckets (vLLM's ``vllm/v1/metrics/buckets.py``: ``PREFILL_LATENCY`` for TTFT,
``TOKEN_STEP_LATENCY`` for inter-token latency, ``ACCUMULATED_PHASE_LATENCY`` for end-to-end and
queue time), so vLLM dashboards and alerts carry over. Definitions: ``docs/metrics.md``.

Each histogram has one label, ``model_name``: the served model's name, or
``TENANT_ID/ADAPTER`` for an adapter (adapter names are unique per tenant only). Tenants upload
adapters, so the values are capped: the first ``max_adapter_labels`` adapters to answer a
request since start get their own series, at most a quarter of them (at least one) per tenant,
and every other adapter request is counted under ``model_name="(other)"``. Names of unknown
models never reach a label (their requests are refused before), and the cap holds the memory
as well as the series: past it nothing new is remembered.

Observations are plain integer and float updates (no lock): every one is made on the app's
event loop, and so is every scrape (``/metrics`` renders on the loop), so none can interleave.
An inter-token observation of ``k`` tokens delivered together is one bisect and two additions.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from loraplex.engine.request import RequestOutput

TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
"""vLLM's ``PREFILL_LATENCY`` buckets (seconds), those of ``vllm:time_to_first_token_seconds``."""

ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
"""vLLM's ``TOKEN_STEP_LATENCY`` buckets (seconds): ``vllm:inter_token_latency_seconds``'s."""

REQUEST_BUCKETS = (
    *(0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0),
    *(60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
"""vLLM's ``ACCUMULATED_PHASE_LATENCY`` buckets (seconds), those of
``vllm:e2e_request_latency_seconds`` and ``vllm:request_queue_time_seconds``."""

OTHER = "(other)"
"""The ``model_name`` of adapter requests past the label cap (no adapter name has parentheses)."""

LABEL = "model_name"


class Series:
    """One label value's histogram: per-bucket counts (not cumulative) and the sum.

    Args:
        bounds: The buckets' upper bounds (seconds), increasing; ``+Inf`` is implied.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float, count: int = 1) -> None:
        """Count ``count`` observations of ``seconds`` (``le``: a bound includes its value)."""
        self.counts[bisect_left(self.bounds, seconds)] += count
        self.sum += seconds * count


class ModelSeries:
    """The four histograms of one ``model_name``.

    Attributes:
        ttft: Time to first token.
        itl: Inter-token latency, one observation per output token after a choice's first.
        e2e: End-to-end latency of requests that finished ``ok``.
        queue: Queue time of requests that finished ``ok``.
    """

    __slots__ = ("ttft", "itl", "e2e", "queue")

    def __init__(self) -> None:
        self.ttft = Series(TTFT_BUCKETS)
        self.itl = Series(ITL_BUCKETS)
        self.e2e = Series(REQUEST_BUCKETS)
        self.queue = Series(REQUEST_BUCKETS)

    def finished(self, ok: bool, ttft: float | None, e2e: float, queue_time: float | None) -> None:
        """Record a request that ended (seconds).

        Its TTFT if it had a first token; its end-to-end latency and queue time if it
        finished ``ok``.
        """
        if ttft is not None:
            self.ttft.observe(ttft)
        if ok:
            self.e2e.observe(e2e)
            if queue_time is not None:
                self.queue.observe(queue_time)


class TokenClock:
    """Inter-token latency of one request, measured as its outputs reach the gateway.

    Per choice: the time since the delivery that brought its previous token, spread evenly
    over the tokens this delivery brings (``k`` tokens after a gap of ``g`` seconds: ``k``
    observations of ``g / k``). A choice's first delivery is its first token (TTFT's), so a
    choice of ``N`` tokens, one per step, adds ``N - 1`` observations.

    Args:
        itl: The histogram observed.
    """

    __slots__ = ("itl", "seen", "last")

    def __init__(self, itl: Series) -> None:
        self.itl = itl
        self.seen: list[int] = []  # per choice index: tokens delivered so far
        self.last: list[float] = []  # per choice index: when its latest tokens arrived

    def output(self, out: RequestOutput, now: float) -> None:
        """Observe one engine output that arrived at ``now`` (``time.perf_counter()``)."""
        seen, last = self.seen, self.last
        for choice in out.outputs:
            i = choice.index
            while len(seen) <= i:
                seen.append(0)
                last.append(now)
            new = len(choice.token_ids)  # a DELTA output: the tokens it brings
            if new <= 0:
                continue
            if seen[i]:
                self.itl.observe((now - last[i]) / new, new)
            seen[i] += new
            last[i] = now


_FAMILIES = (
    ("ttft", "loraplex_time_to_first_token_seconds", "Time to first token (seconds)"),
    (
        "itl",
        "loraplex_inter_token_latency_seconds",
        "Time between a choice's consecutive output tokens, as they reach the gateway (seconds)",
    ),
    (
        "e2e",
        "loraplex_e2e_request_latency_seconds",
        "Admission to last token of requests that finished ok (seconds)",
    ),
    (
        "queue",
        "loraplex_request_queue_time_seconds",
        "Arrival at the engine to first scheduled, of requests that finished ok (seconds)",
    ),
)


class LatencyMetrics(Collector):
    """The per-model latency histograms and their capped ``model_name`` labels.

    Args:
        base_model: The served model's name (always its own label, outside the cap).
        max_adapter_labels: Adapters that may get a label of their own (0: every adapter
            request is ``"(other)"``).

    Raises:
        ValueError: ``max_adapter_labels`` is negative.
    """

    def __init__(self, base_model: str, max_adapter_labels: int) -> None:
        if max_adapter_labels < 0:
            raise ValueError("max_adapter_labels must be >= 0")
        self.base_model = base_model
        self.max_adapter_labels = max_adapter_labels
        self.per_tenant = max(1, max_adapter_labels // 4)
        self.base = ModelSeries()
        self.other = ModelSeries()
        self._adapters: dict[tuple[str, str], ModelSeries] = {}
        self._per_tenant: dict[str, int] = {}

    def for_model(self, tenant_id: str, adapter: str | None) -> ModelSeries:
        """The series of a request: the base model's, the adapter's, or ``"(other)"``.

        Args:
            tenant_id: The adapter's owner.
            adapter: The adapter's name as the request gave it (an existing adapter of this
                tenant), None for the base model.
        """
        if adapter is None:
            return self.base
        key = (tenant_id, adapter)
        found = self._adapters.get(key)
        if found is not None:
            return found
        held = self._per_tenant.get(tenant_id, 0)
        if len(self._adapters) >= self.max_adapter_labels or held >= self.per_tenant:
            return self.other
        found = self._adapters[key] = ModelSeries()
        self._per_tenant[tenant_id] = held + 1
        return found

    def label_values(self) -> list[tuple[str, ModelSeries]]:
        """``(model_name, series)`` pairs: the base model first, ``"(other)"`` last."""
        pairs = [(self.base_model, self.base)]
        pairs.extend((f"{tenant}/{name}", s) for (tenant, name), s in self._adapters.items())
        pairs.append((OTHER, self.other))
        return pairs

    def collect(self) -> Iterator[HistogramMetricFamily]:
        """The four histogram families (called at scrape time, on the event loop)."""
        pairs = self.label_values()
        for attr, name, doc in _FAMILIES:
            yield _family(name, doc, attr, pairs)


def _family(
    name: str, doc: str, attr: str, pairs: list[tuple[str, ModelSeries]]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=[LABEL])
    for label, model in pairs:
        series: Series = getattr(model, attr)
        cumulative, buckets = 0, []
        for bound, count in zip(series.bounds, series.counts, strict=False):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        buckets.append(("+Inf", cumulative + series.counts[-1]))
        family.add_metric([label], buckets, series.sum)
    return family
