"""Query-of-death defence, live (issue 27 item 2): a request body tied to an injected native fault
(``LORAPLEX_TEST_CRASH_ON_TOKENS``: the core SIGSEGVs when it admits a prompt holding those
tokens) kills the engine core twice, is quarantined, and is refused with a 400 from then on;
the server stays up serving the other tenants through ten such requests, does not count the
explained deaths towards giving up, throttles the tenant that varies the body, and a server
started later on the same data directory refuses the body at once."""

import httpx
import pytest
from transformers import AutoTokenizer

from loraplex.engine.client.front import AsyncLLM
from loraplex.engine.client.process import ProcessCoreClient
from loraplex.engine.client.quarantine import Quarantine, QuarantinePolicy
from loraplex.engine.config import EngineConfig
from loraplex.engine.core.launch import ProcessLauncher
from loraplex.engine.core.process import CRASH_ON_TOKENS_ENV
from tests.gateway.chat_support import BackgroundStream, long_stream_body, usage_events, wait_for
from tests.gateway.live import LiveGateway

pytestmark = pytest.mark.slow

MARKER = "zebra quartz velvet"


def marker_ids(model_dir) -> list[int]:
    """Token ids of the marker as the chat template tokenizes it inside a user message."""
    tok = AutoTokenizer.from_pretrained(model_dir)

    def ids(text):
        return tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )

    plain, marked = ids("Say hello ."), ids(f"Say hello {MARKER} .")
    start = next(i for i, (a, b) in enumerate(zip(plain, marked, strict=False)) if a != b)
    return marked[start : start + 3]


def engine_with_fault(tiny_text_dir, tmp_path_factory, where: str):
    """A core process that SIGSEGVs on the marker: at admission (its breadcrumb names the
    request) or before the step that runs it (no breadcrumb: only suspects). The fault is in
    the launcher's environment, so every restarted core has it too."""
    marker = where + ":" + ",".join(map(str, marker_ids(tiny_text_dir)))
    data = tmp_path_factory.mktemp("qod")
    quarantine = Quarantine(data / "quarantine.jsonl", QuarantinePolicy(tenant_deaths=3))
    config = EngineConfig(model=str(tiny_text_dir), served_model_name="tiny", num_kv_blocks=128)
    core = ProcessCoreClient(
        config,
        str(data / "store"),
        launcher=ProcessLauncher({CRASH_ON_TOKENS_ENV: marker}),
        quarantine=quarantine,
    )
    core.start()
    client = AsyncLLM(core, config, model_name="tiny")
    return client, data, quarantine


@pytest.fixture(scope="module")
def setup(tiny_text_dir, tmp_path_factory):
    client, data, quarantine = engine_with_fault(tiny_text_dir, tmp_path_factory, "step")
    yield client, data, quarantine
    client.shutdown()


def chat(c, key, text, **extra):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }
    return c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_ten_queries_of_death_cost_two_deaths(setup):
    """A fault outside any breadcrumb (as in the batched forward pass): suspects only."""
    client, data, quarantine = setup
    core = client.core
    with LiveGateway(client, data / "gw") as live:
        evil = live.create_tenant("evil")["api_key"]
        good = live.create_tenant("good")["api_key"]
        with httpx.Client(base_url=live.base_url, timeout=120) as c:
            assert chat(c, good, "Hello there").status_code == 200
            bystander = BackgroundStream(
                live, long_stream_body("tiny"), {"Authorization": f"Bearer {good}"}
            ).start()
            assert bystander.first_chunk.wait(30)
            # Established, not fresh: the core stepped it a few times since it took it, so a
            # death now is not shared with it (suspects: what the core took in its last two
            # loops). On a loaded machine the first chunk alone can come within those two.
            assert wait_for(lambda: sum(x.startswith("data: {") for x in bystander.lines) >= 4)
            statuses, pids = [], [core.pid]
            for _ in range(10):
                r = chat(c, evil, f"Say hello {MARKER} .")
                statuses.append((r.status_code, r.json()["error"]["code"]))
                assert wait_for(lambda: c.get("/health").status_code == 200, timeout=120)
                pids.append(core.pid)
                # the bystander is served between the attacks
                assert chat(c, good, "Tell me a story").status_code == 200
            bystander.join(60)
        assert statuses[:2] == [(503, "engine_unavailable")] * 2
        assert statuses[2:] == [(400, "request_quarantined")] * 8
        assert len(set(pids)) == 3 and core.restarts == 2  # two deaths, then none
        assert not core.failed
        assert quarantine.stats()["quarantined_requests"] == 1
        # the bystander's stream, in flight (not fresh) at the first death, ended with 503;
        # nothing of the bystander's is quarantined or throttled
        assert '"engine_unavailable"' in "".join(bystander.lines)
        rows = usage_events(live, evil)
        assert [r.error_type for r in rows][-8:] == ["request_quarantined"] * 8

        # a tenant that varies the body gets new digests: its third death throttles it
        with httpx.Client(base_url=live.base_url, timeout=120) as c:
            r = chat(c, evil, f"Say hello {MARKER} . again")
            assert r.status_code == 503  # a new body: a new death
            assert wait_for(lambda: c.get("/health").status_code == 200, timeout=120)
            r = chat(c, evil, f"Say hello {MARKER} . and again")
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_engine_faults"
            assert int(r.headers["Retry-After"]) > 1
            assert chat(c, evil, "An innocent question").status_code == 429
            assert chat(c, good, "Tell me a story").status_code == 200  # not the bystander
        assert core.restarts == 3 and not core.failed
        metrics = live.metrics()
        assert "loraplex_engine_core_deaths_total 3.0" in metrics
        assert "loraplex_quarantine_refusals_total 10.0" in metrics  # 8 bodies, 2 throttled
        # towards giving up (5 deaths in 300 s), only the varied body's death counts
        assert [quarantine.explained(k) for _, k in core._deaths] == [True, True, False]

    # a server started afterwards on the same data directory knows the body already
    again = Quarantine(data / "quarantine.jsonl")
    assert again.stats()["quarantined_requests"] == 1
    assert again.stats()["engine_deaths_recorded"] == 3


def test_a_fault_inside_a_breadcrumb_quarantines_its_request_at_the_first_death(
    tiny_text_dir, tmp_path_factory
):
    client, data, quarantine = engine_with_fault(tiny_text_dir, tmp_path_factory, "admit")
    try:
        with LiveGateway(client, data / "gw") as live:
            evil = live.create_tenant("evil")["api_key"]
            good = live.create_tenant("good")["api_key"]
            with httpx.Client(base_url=live.base_url, timeout=120) as c:
                busy = [  # the bystander's requests arrive beside the attack: fresh suspects
                    BackgroundStream(
                        live, long_stream_body("tiny"), {"Authorization": f"Bearer {good}"}
                    ).start()
                    for _ in range(2)
                ]
                r = chat(c, evil, f"Say hello {MARKER} .")
                assert r.status_code == 503
                assert wait_for(lambda: c.get("/health").status_code == 200, timeout=120)
                for stream in busy:
                    stream.join(60)
                statuses = [chat(c, evil, f"Say hello {MARKER} .").status_code for _ in range(5)]
                assert statuses == [400] * 5  # named by its breadcrumb: quarantined at once
                assert chat(c, good, "Tell me a story").status_code == 200
        assert client.core.restarts == 1
        assert quarantine.stats()["quarantined_requests"] == 1  # the attack, not the streams
    finally:
        client.shutdown()
