"""The engine with KV tiers: evicted prefixes come back from host memory and disk.

Oracle: the same engine configuration without tiers (recompute) gives the same greedy tokens;
the tiny text model in float32. "Evicted" is made exact with ``reset_prefix_cache`` (every
hash dropped from the pool while no block is in use), so each test controls what the pool
still holds.
"""

import pytest
import torch

from loraplex.engine.client.llm import LLM
from loraplex.engine.config import EngineConfig
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams

BS = 16


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, 250, (n,), generator=g).tolist()


def ask(llm, rid, tokens, *, salt=None, max_tokens=6):
    req = EngineRequest(
        rid, list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens), cache_salt=salt
    )
    (out,) = llm.generate([req])
    return out


def evict_all(llm):
    assert llm.engine.kv.reset_prefix_cache()


def settle(llm):
    """Wait for the offloads of finished steps and the store's writes."""
    engine = llm.engine.core
    while engine.kv_tiers.busy:
        engine.kv_tiers.wait(0.05)
        engine.kv_tiers.poll(engine.scheduler.add)
    assert engine.kv_tiers.store.flush(10)
    assert engine.kv.num_pinned == 0


@pytest.fixture(scope="module")
def reference(tiny_text_dir, make_llm):
    return make_llm(model=tiny_text_dir, num_kv_blocks=64)


def config(model, **tiers):
    return EngineConfig(model=model, num_kv_blocks=64, **tiers)


@pytest.fixture
def host_llm(tiny_text_dir):
    llm = LLM(config(tiny_text_dir, kv_offloading_bytes=64 << 20))
    yield llm
    llm.shutdown()


def test_an_evicted_prefix_comes_back_from_the_host_tier_with_the_same_tokens(host_llm, reference):
    tokens = prompt(100, seed=1)  # 6 full blocks; the last token is always computed
    first = ask(host_llm, "a", tokens)
    settle(host_llm)
    evict_all(host_llm)
    again = ask(host_llm, "b", tokens)
    expected = ask(reference, "ref", tokens)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == expected.outputs[0].token_ids
    assert again.num_cached_tokens == 6 * BS  # counted as cached (usage's cached_tokens)
    stats = host_llm.engine.core.stats()
    assert stats["kv_tier_loaded_blocks"] == 6 and stats["kv_tier_loads"] == 1
    assert stats["kv_tier_offloaded_blocks"] >= 6
    assert host_llm.engine.kv.num_pinned == 0 and host_llm.engine.kv.pool.num_used == 0
    # The same figures on /metrics, by tier.
    from prometheus_client import CollectorRegistry, generate_latest

    from loraplex.gateway.metrics.registry import _EngineCollector

    registry = CollectorRegistry()
    registry.register(_EngineCollector(host_llm.engine.core.stats))
    text = generate_latest(registry).decode()
    assert 'loraplex_kv_tier_loaded_blocks_total{tier="host"} 6.0' in text
    assert 'loraplex_kv_tier_hits_total{tier="host"} 6.0' in text
    assert "loraplex_kv_tier_loads_total 1.0" in text


def test_a_prefix_still_in_the_pool_is_not_loaded_again(host_llm):
    tokens = prompt(70, seed=2)
    ask(host_llm, "a", tokens)
    settle(host_llm)
    out = ask(host_llm, "b", tokens)
    assert out.num_cached_tokens == 4 * BS
    assert host_llm.engine.core.stats()["kv_tier_loads"] == 0


def test_another_tenants_salt_never_loads_the_blocks(host_llm, reference):
    tokens = prompt(100, seed=3)
    ask(host_llm, "a", tokens, salt="tenant-a")
    settle(host_llm)
    evict_all(host_llm)
    other = ask(host_llm, "b", tokens, salt="tenant-b")
    assert other.num_cached_tokens == 0
    assert host_llm.engine.core.stats()["kv_tier_loads"] == 0
    assert other.outputs[0].token_ids == ask(reference, "r", tokens).outputs[0].token_ids
    same = ask(host_llm, "c", tokens, salt="tenant-a")
    assert same.num_cached_tokens == 6 * BS


def test_a_request_aborted_while_its_blocks_load_frees_everything(host_llm):
    engine = host_llm.engine.core
    tokens = prompt(100, seed=4)
    ask(host_llm, "a", tokens)
    settle(host_llm)
    evict_all(host_llm)
    engine.add_request(EngineRequest("b", tokens, SamplingParams(temperature=0, max_tokens=4)))
    assert "b" in engine.kv_tiers and engine.has_unfinished_requests()
    assert engine.abort_request("b")
    settle(host_llm)
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_used == 0 and "b" not in engine.scheduler.requests


def test_the_disk_tier_survives_a_restart_and_a_corrupt_block_is_recomputed(
    tiny_text_dir, tmp_path, reference
):
    disk = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=64 << 20)
    tokens = prompt(100, seed=5)
    expected = ask(reference, "r", tokens).outputs[0].token_ids
    first = LLM(config(tiny_text_dir, **disk))
    try:
        ask(first, "a", tokens)
        settle(first)
    finally:
        first.shutdown()
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) >= 6
    second = LLM(config(tiny_text_dir, **disk))  # a restart: a new engine on the same directory
    try:
        out = ask(second, "b", tokens)
        assert out.num_cached_tokens == 6 * BS and out.outputs[0].token_ids == expected
        settle(second)
    finally:
        second.shutdown()
    # Flip one byte of the 3rd block's record: blocks 3.. are recomputed, never served.
    engine_files = {f.stem: f for f in files}
    third = LLM(config(tiny_text_dir, **disk))
    try:
        from loraplex.hashing.request_hasher import RequestBlockHasher

        hasher = RequestBlockHasher(BS)
        hasher.extend(tokens)
        victim = engine_files[hasher.block_hashes[2].hex()]
        data = bytearray(victim.read_bytes())
        data[-7] ^= 0xFF
        victim.write_bytes(bytes(data))
        out = ask(third, "c", tokens)
        assert out.num_cached_tokens == 2 * BS and out.outputs[0].token_ids == expected
        assert third.engine.core.stats()["kv_tier_disk_corrupt"] == 1
    finally:
        third.shutdown()


def test_a_different_model_never_reads_the_disk_tier(tiny_text_dir, tiny_llava_dir, tmp_path):
    disk = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=64 << 20)
    a = LLM(config(tiny_text_dir, **disk))
    try:
        ask(a, "a", prompt(100, seed=6))
        settle(a)
    finally:
        a.shutdown()
    (first_dir,) = [p for p in (tmp_path / "kv").iterdir() if p.is_dir()]
    b = LLM(config(tiny_llava_dir, **disk))
    try:
        out = ask(b, "b", prompt(100, seed=6))
        assert out.num_cached_tokens == 0 and b.engine.core.stats()["kv_tier_loads"] == 0
        settle(b)
    finally:
        b.shutdown()
    dirs = sorted(p for p in (tmp_path / "kv").iterdir() if p.is_dir())
    assert len(dirs) == 2 and first_dir in dirs  # its own fingerprint's directory


def test_tiers_with_a_draft_model_or_without_prefix_caching_are_refused():
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(model="m", kv_offloading_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_remote_bytes"):
        EngineConfig(model="m", kv_remote_url="redis://localhost:6379/0")
    with pytest.raises(ValueError, match="redis"):
        EngineConfig(model="m", kv_remote_url="http://x", kv_remote_bytes=1 << 20)


def test_a_load_while_others_decode_is_paced_between_steps_and_exact(host_llm, reference):
    engine = host_llm.engine
    core = engine.core
    tokens = prompt(200, seed=8)  # 12 full blocks
    ask(host_llm, "a", tokens)
    settle(host_llm)
    evict_all(host_llm)
    engine.add_request(
        EngineRequest(
            "other",
            prompt(20, seed=9),
            SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
        )
    )
    engine.step()
    polls = []
    real_poll = core.kv_tiers.poll
    core.kv_tiers.poll = lambda queue, budget=None: polls.append(budget) or real_poll(queue, budget)
    try:
        engine.add_request(EngineRequest("b", tokens, SamplingParams(temperature=0, max_tokens=6)))
        outs = {}
        while "b" not in outs or not outs["b"].finished:
            for out in engine.step():
                if out.request_id == "b":
                    outs["b"] = out
        engine.abort_request("other")
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        core.kv_tiers.poll = real_poll
    # The load was budgeted (another request ran), not done in one go, and still exact.
    assert polls and all(b is not None for b in polls[:2])
    assert core.stats()["kv_tier_loaded_blocks"] == 12
    expected = ask(reference, "r", tokens).outputs[0].token_ids
    assert outs["b"].num_cached_tokens == 12 * BS
    assert ask(host_llm, "c", tokens).outputs[0].token_ids == expected
    assert core.kv.num_pinned == 0


@pytest.mark.service
def test_two_replicas_sharing_a_redis_tier_give_the_tokens_of_recompute(
    tiny_text_dir, tmp_path, reference
):
    from tests.redis_server import redis_server

    tokens = prompt(100, seed=11)
    expected = ask(reference, "r", tokens).outputs[0].token_ids
    with redis_server(tmp_path) as url:
        remote = dict(kv_remote_url=url, kv_remote_bytes=64 << 20)
        a, b = LLM(config(tiny_text_dir, **remote)), LLM(config(tiny_text_dir, **remote))
        try:
            ask(a, "a", tokens, salt="t1")
            settle(a)
            other_tenant = ask(b, "x", tokens, salt="t2")  # same tokens, another tenant's salt
            assert other_tenant.num_cached_tokens == 0
            out = ask(b, "b", tokens, salt="t1")  # b's pool never saw it: loaded from Redis
            assert out.num_cached_tokens == 6 * BS and out.outputs[0].token_ids == expected
            assert b.engine.core.stats()["kv_tier_remote_hits"] == 6
        finally:
            a.shutdown()
            b.shutdown()
