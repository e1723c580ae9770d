"""Admission control: past the global bound on outstanding work, 503 + Retry-After; one
tenant's share is capped so another tenant always gets in (issue 13)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.fake_engine import InstantEngine
from loraplex.gateway.limits.admission import AdmissionControl, OverloadedError
from tests.gateway.live import NO_LIMITS, LiveGateway


def test_bounds_shares_and_release():
    control = AdmissionControl(max_requests=4, max_tokens=100, tenant_share=0.5)
    a1, a2 = control.admit("a"), control.admit("a")
    with pytest.raises(OverloadedError, match="per tenant"):
        control.admit("a")
    b1 = control.admit("b")
    a1.reserve_tokens(40)
    with pytest.raises(OverloadedError, match="per tenant"):
        a2.reserve_tokens(11)  # a's share of tokens is 50
    b1.reserve_tokens(50)
    b2 = control.admit("b")
    with pytest.raises(OverloadedError, match="limit of 4 requests"):
        control.admit("c")
    with pytest.raises(OverloadedError, match="limit of 100 tokens"):
        b2.reserve_tokens(11)
    a1.release()
    a1.release()  # once only
    assert control.outstanding() == (3, 50) and control.outstanding("a") == (1, 0)
    for t in (a2, b1, b2):
        t.release()
    assert control.outstanding() == (0, 0)


def test_the_gateway_answers_503_past_the_bound_and_another_tenant_still_gets_in(tmp_path):
    gate = threading.Event()
    engine = InstantEngine("instant", gate=gate)
    limits = dict(NO_LIMITS, max_outstanding_requests=4, tenant_share=0.5)
    with LiveGateway(engine, tmp_path, **limits) as live:
        a, b = live.create_tenant("a")["api_key"], live.create_tenant("b")["api_key"]
        body = {"model": "instant", "messages": [{"role": "user", "content": "hi"}]}

        def chat(key):
            with httpx.Client(base_url=live.base_url, timeout=30) as c:
                return c.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )

        with ThreadPoolExecutor(4) as pool:
            held = [pool.submit(chat, a) for _ in range(2)]  # wait at the gate
            while engine.in_flight < 2:
                threading.Event().wait(0.01)
            refused = chat(a)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
            other = pool.submit(chat, b)  # b's half is free
            while engine.in_flight < 3:
                threading.Event().wait(0.01)
            gate.set()
            assert [f.result().status_code for f in [*held, other]] == [200, 200, 200]
        assert chat(a).status_code == 200  # released with the usage rows
        assert live.state.admission.outstanding() == (0, 0)


def test_serve_flags_set_the_bounds(tmp_path):
    from loraplex.gateway.cli import build_parser
    from loraplex.gateway.commands.serve import gateway_config_from_args

    def config(*flags):
        args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), *flags])
        return gateway_config_from_args(args, "m")

    defaults = config()
    assert (defaults.max_outstanding_requests, defaults.tenant_share) == (1024, 0.5)
    c = config("--max-outstanding-requests", "0", "--max-outstanding-tokens", "500")
    assert (c.max_outstanding_requests, c.max_outstanding_tokens) == (None, 500)
    c = config("--tenant-share", "1", "--max-concurrent-uploads", "5", "--no-usage-fsync")
    assert (c.tenant_share, c.max_concurrent_uploads, c.usage_spool_fsync) == (1.0, 5, False)
    assert (
        defaults.usage_spool_fsync and config("--usage-backlog-limit", "9").usage_backlog_limit == 9
    )
    unlimited = config("--requests-per-minute", "0", "--tokens-per-minute", "0")
    assert (unlimited.default_requests_per_minute, unlimited.default_tokens_per_minute) == (
        None,
        None,
    )
    c = config("--max-concurrent-requests", "0", "--requests-per-minute", "5")
    assert (c.default_max_concurrent_requests, c.default_requests_per_minute) == (None, 5)
    for bad in (
        ["--requests-per-minute", "-1"],
        ["--tenant-share", "0"],
        ["--tenant-share", "1.5"],
        ["--max-outstanding-requests", "-1"],
        ["--max-concurrent-uploads", "0"],
    ):
        with pytest.raises(ValueError):
            config(*bad)
