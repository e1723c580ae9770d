"""The latency histograms' pieces: bucket counting, per-token ITL, the capped model labels."""

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.request import CompletionOutput, RequestOutput
from loraplex.gateway.metrics.latency import (
    ITL_BUCKETS,
    OTHER,
    LatencyMetrics,
    Series,
    TokenClock,
)
from loraplex.gateway.metrics.registry import GatewayMetrics

FAMILIES = (
    "loraplex_time_to_first_token_seconds",
    "loraplex_inter_token_latency_seconds",
    "loraplex_e2e_request_latency_seconds",
    "loraplex_request_queue_time_seconds",
)


def samples(text, family):
    """``{(sample name, labels as a sorted tuple): value}`` of one family."""
    found = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_series_counts_as_prometheus_client_histogram_does():
    # The oracle: prometheus_client's own Histogram, fed the same values (bounds included).
    registry = CollectorRegistry()
    oracle = Histogram("x_seconds", "x", ["model_name"], buckets=ITL_BUCKETS, registry=registry)
    metrics = GatewayMetrics(dict, "m", 4)
    ours = metrics.latency.for_model("t", None).itl
    rng = random.Random(7)
    values = [rng.choice(ITL_BUCKETS) for _ in range(200)]  # on a bound: in its bucket (le)
    values += [rng.expovariate(5) for _ in range(800)] + [0.0, 1e-9, 1000.0]
    for v in values:
        oracle.labels("m").observe(v)
        ours.observe(v)
    theirs = samples(generate_latest(registry).decode(), "x_seconds")
    mine = samples(metrics.render().decode(), "loraplex_inter_token_latency_seconds")
    assert len(theirs) > len(ITL_BUCKETS)
    for (name, labels), value in theirs.items():
        if name.endswith("_created"):
            continue
        ours_name = name.replace("x_seconds", "loraplex_inter_token_latency_seconds")
        assert mine[(ours_name, labels)] == pytest.approx(value), (name, labels)


def test_a_delivery_of_k_tokens_is_k_observations_of_the_gap_over_k():
    series = Series(ITL_BUCKETS)
    clock = TokenClock(series)

    def out(*lengths):
        return RequestOutput(
            "r",
            [1],
            [CompletionOutput(i, "", [7] * n) for i, n in enumerate(lengths)],
            finished=False,
        )

    clock.output(RequestOutput("r", [1], [CompletionOutput(0, "", [])], False), 0.0)  # prefill
    clock.output(out(1, 1), 1.0)  # n=2 forked: each choice's first token, no ITL yet
    assert sum(series.counts) == 0
    # DELTA outputs: each choice's tokens new since the previous output.
    clock.output(out(1, 3), 1.5)  # choice 0: one token after 0.5 s; choice 1: three after 0.5 s
    clock.output(out(0, 1), 2.5)  # choice 0 finished (no new token); choice 1: one after 1 s
    assert sum(series.counts) == 1 + 3 + 1 == (2 - 1) + (5 - 1)
    assert series.sum == pytest.approx(0.5 + 3 * (0.5 / 3) + 1.0)
    assert series.counts[ITL_BUCKETS.index(0.2)] == 3  # 0.1666 s: le 0.2
    assert series.counts[ITL_BUCKETS.index(0.5)] == 1
    assert series.counts[ITL_BUCKETS.index(1.0)] == 1


def test_ten_thousand_adapter_names_do_not_make_ten_thousand_series():
    cap = 32
    metrics = GatewayMetrics(dict, "base-model", cap)
    latency = metrics.latency
    hostile = [latency.for_model("hostile", f"adapter-{i}") for i in range(10_000)]
    for s in hostile:
        s.finished(True, 0.01, 0.5, 0.001)
    # One tenant holds at most a quarter of the labels: the others still get theirs.
    honest = [latency.for_model(f"tenant-{t}", "prod") for t in range(40)]
    for s in honest:
        s.finished(True, 0.02, 1.0, 0.002)
    latency.for_model("t", None).finished(True, 0.03, 2.0, 0.003)
    text = metrics.render().decode()
    for family in FAMILIES:
        names = {dict(labels)["model_name"] for _, labels in samples(text, family)}
        assert len(names) <= cap + 2  # the base model and "(other)" besides the cap
        assert {"base-model", OTHER} <= names
    counts = {
        dict(labels)["model_name"]: value
        for (name, labels), value in samples(text, FAMILIES[0]).items()
        if name.endswith("_count")
    }
    assert sum(counts.values()) == 10_000 + 40 + 1  # nothing is lost, only pooled
    hostile_labels = [name for name in counts if name.startswith("hostile/")]
    assert len(hostile_labels) == cap // 4
    assert sum(name.startswith("tenant-") for name in counts) == cap - cap // 4
    assert len(latency._adapters) == cap  # and nothing past the cap is remembered


def test_no_adapter_label_at_zero_and_a_negative_cap_is_refused():
    metrics = GatewayMetrics(dict, "base-model", 0)
    assert metrics.latency.for_model("t", "secret-name") is metrics.latency.other
    assert "secret-name" not in metrics.render().decode()
    with pytest.raises(ValueError):
        LatencyMetrics("m", -1)


def test_serve_flag_sets_the_cap(tmp_path):
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import gateway_config_from_args

    def config(*flags):
        args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *flags])
        return gateway_config_from_args(args, "m")

    assert config().metrics_max_adapter_labels == 32
    assert config("--metrics-max-adapter-labels", "0").metrics_max_adapter_labels == 0
    with pytest.raises(ValueError):
        config("--metrics-max-adapter-labels", "-1")
