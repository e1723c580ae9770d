"""The latency histograms of a live gateway after real requests, read as Prometheus reads them."""

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.chat_support import register_adapter
from tests.gateway.conftest import adapter_store_dir
from tests.gateway.live import LiveGateway

MODEL = "tiny-llava"
HELLO = [{"role": "user", "content": "say something"}]

# vLLM's buckets (vllm/v1/metrics/buckets.py), written out here as the oracle.
PREFILL_LATENCY = "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 2.5 5.0 7.5 10.0 "
PREFILL_LATENCY += "20.0 40.0 80.0 160.0 640.0 2560.0"
TOKEN_STEP_LATENCY = "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 "
TOKEN_STEP_LATENCY += "20.0 40.0 80.0"
PHASE_LATENCY = "0.1 0.2 0.3 0.5 0.8 1.0 1.5 2.0 2.5 5.0 10.0 15.0 20.0 30.0 40.0 50.0 60.0 "
PHASE_LATENCY += "120.0 240.0 480.0 960.0 1920.0 7680.0"
VLLM_BUCKETS = {
    "loraplex_time_to_first_token_seconds": PREFILL_LATENCY.split(),
    "loraplex_inter_token_latency_seconds": TOKEN_STEP_LATENCY.split(),
    "loraplex_e2e_request_latency_seconds": PHASE_LATENCY.split(),
    "loraplex_request_queue_time_seconds": PHASE_LATENCY.split(),
}


def histograms(live) -> dict[str, dict[str, dict]]:
    """``{family: {model_name: {"count", "sum", "buckets": [(le, cumulative count)]}}}``."""
    text = live.metrics()
    found: dict[str, dict[str, dict]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in VLLM_BUCKETS:
            continue
        assert fam.type == "histogram"
        by_model = found.setdefault(fam.name, {})
        for s in fam.samples:
            h = by_model.setdefault(s.labels["model_name"], {"buckets": []})
            if s.name.endswith("_bucket"):
                h["buckets"].append((s.labels["le"], s.value))
            elif s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
    assert set(found) == set(VLLM_BUCKETS)
    return found


def chat(live, key, model=MODEL, stream=False, **extra) -> dict:
    """One chat completion; its ``usage`` (streaming: from the last chunk)."""
    body = {"model": model, "messages": HELLO, "temperature": 1.0, "seed": 3, **extra}
    with live.client(key) as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        return json.loads(lines[-1][len("data: ") :])["usage"]


def test_histograms_count_requests_and_output_tokens(live, tiny_adapter):
    tenant = live.create_tenant("metrics")
    key = tenant["api_key"]
    register_adapter(live, tenant["id"], "my-lora", tiny_adapter)
    runs = [  # (n, usage): streaming and not, n > 1
        (1, chat(live, key, max_tokens=6)),
        (1, chat(live, key, max_tokens=5, stream=True)),
        (3, chat(live, key, max_tokens=4, n=3)),
        (2, chat(live, key, max_tokens=7, n=2, stream=True)),
    ]
    adapter_usage = chat(live, key, model="my-lora", max_tokens=5)
    with live.client(key) as c:  # an unknown model: 404, and no label
        assert c.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO}).is_error

    found = histograms(live)
    for family, by_model in found.items():
        for model, h in by_model.items():  # every series has vLLM's buckets, cumulative
            les = [le for le, _ in h["buckets"]]
            assert les == [*VLLM_BUCKETS[family], "+Inf"], (family, model)
            counts = [v for _, v in h["buckets"]]
            assert counts == sorted(counts) and counts[-1] == h["count"]
    base = {family: by_model[MODEL] for family, by_model in found.items()}
    adapter = {family: by_model[f"{tenant['id']}/my-lora"] for family, by_model in found.items()}
    assert all("nope" not in name for by_model in found.values() for name in by_model)

    # One TTFT, one end-to-end latency and one queue time per request.
    for family in (
        "loraplex_time_to_first_token_seconds",
        "loraplex_e2e_request_latency_seconds",
        "loraplex_request_queue_time_seconds",
    ):
        assert base[family]["count"] == len(runs), family
        assert adapter[family]["count"] == 1, family
    # One inter-token latency per output token after each choice's first.
    itl = "loraplex_inter_token_latency_seconds"
    assert base[itl]["count"] == sum(u["completion_tokens"] - n for n, u in runs)
    assert adapter[itl]["count"] == adapter_usage["completion_tokens"] - 1
    assert base[itl]["sum"] > 0 and base["loraplex_e2e_request_latency_seconds"]["sum"] > 0
    # Queue time ends before the first token, which comes before the end.
    e2e, ttft = "loraplex_e2e_request_latency_seconds", "loraplex_time_to_first_token_seconds"
    queue = "loraplex_request_queue_time_seconds"
    assert base[queue]["sum"] <= base[ttft]["sum"] <= base[e2e]["sum"]


def test_adapter_labels_are_capped_through_the_app(engine_client, tmp_path, tiny_adapter):
    store = adapter_store_dir(Path(engine_client.config.model))
    with LiveGateway(
        engine_client, tmp_path / "data", adapter_store_dir=store, metrics_max_adapter_labels=1
    ) as live:
        first, second = live.create_tenant("first"), live.create_tenant("second")
        register_adapter(live, first["id"], "lora-a", tiny_adapter)
        register_adapter(live, first["id"], "lora-b", tiny_adapter)
        register_adapter(live, second["id"], "lora-c", tiny_adapter)
        chat(live, first["api_key"], model="lora-a", max_tokens=2)
        chat(live, first["api_key"], model="lora-b", max_tokens=2)
        chat(live, second["api_key"], model="lora-c", max_tokens=2, stream=True)
        chat(live, first["api_key"], model="lora-a", max_tokens=2)
        found = histograms(live)
    e2e = found["loraplex_e2e_request_latency_seconds"]
    counts = {model: h["count"] for model, h in e2e.items()}
    assert counts == {MODEL: 0, f"{first['id']}/lora-a": 2, "(other)": 2}
