"""Through the live gateway: one tenant's faulty request fails alone, and every combination of
``logprobs``, ``top_logprobs``, ``n`` and ``stream`` answers (issue 13)."""

import asyncio
import itertools
import time

import httpx
import openai
import pytest

from tests.gateway.chat_support import usage_events

pytestmark = pytest.mark.slow

MODEL = "tiny-llava"
STREAMS = 20


def poison_tenant(monkeypatch, engine_client, tenant_id, batches):
    """The engine's forward pass raises whenever a sequence of ``tenant_id`` is in the batch.

    Each failing batch's tenants (cache salts) are appended to ``batches``. Every step is also
    slowed by 5 ms so the bystanders' streams are surely in flight when the fault strikes.
    """
    runner = engine_client.core.engine_core.runner
    forward = runner.forward

    def faulty(items):
        time.sleep(0.005)
        salts = {runner.seqs[item.seq_id].cache_salt for item in items}
        if tenant_id in salts:
            batches.append(salts)
            raise RuntimeError("injected fault")
        return forward(items)

    monkeypatch.setattr(runner, "forward", faulty)


def test_a_faulty_request_fails_alone_while_20_streams_of_another_tenant_complete(
    live, engine_client, monkeypatch
):
    victim = live.create_tenant("victim")
    bystander = live.create_tenant("bystander")
    batches: list[set] = []
    poison_tenant(monkeypatch, engine_client, victim["id"], batches)
    started = asyncio.Event

    async def main():
        ready = started()
        first_chunks = 0
        good = openai.AsyncOpenAI(
            base_url=f"{live.base_url}/v1", api_key=bystander["api_key"], max_retries=0
        )
        bad = openai.AsyncOpenAI(
            base_url=f"{live.base_url}/v1", api_key=victim["api_key"], max_retries=0
        )

        async def stream(i):
            nonlocal first_chunks
            text, finish = "", None
            events = await good.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"story number {i}"}],
                max_tokens=40,
                temperature=0,
                stream=True,
            )
            async for chunk in events:
                if not chunk.choices:
                    continue
                if first_chunks < STREAMS and not text and chunk.choices[0].delta.role:
                    first_chunks += 1
                    if first_chunks == STREAMS:
                        ready.set()
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        async def faulty():
            await ready.wait()
            outcomes = []
            with pytest.raises(openai.InternalServerError) as info:
                await bad.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "boom"}], max_tokens=8
                )
            outcomes.append(info.value.status_code)
            with pytest.raises(openai.APIError) as info:
                events = await bad.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "boom"}],
                    max_tokens=8,
                    stream=True,
                )
                async for _ in events:
                    pass
            outcomes.append(info.value.message)
            return outcomes

        results = await asyncio.gather(*[stream(i) for i in range(STREAMS)], faulty())
        await good.close()
        await bad.close()
        return results

    *streams, outcomes = asyncio.run(main())
    assert all(finish in ("stop", "length") for _, finish in streams), streams
    assert outcomes[0] == 500
    # The fault struck batches that also held the bystander's sequences.
    assert any(bystander["id"] in salts for salts in batches)
    rows = usage_events(live, victim["api_key"])
    assert [(r.status, r.error_type) for r in rows] == [("error", "internal_error")] * 2
    assert all(r.status == "ok" for r in usage_events(live, bystander["api_key"]))
    assert len(usage_events(live, bystander["api_key"])) == STREAMS
    assert engine_client.is_running
    assert httpx.get(f"{live.base_url}/health").status_code == 200


TOP = [None, *range(21)]


def test_every_combination_of_logprobs_top_logprobs_n_and_stream(live):
    tenant = live.create_tenant("grid")
    client = live.openai(tenant["api_key"])
    for logprobs, top, n, stream in itertools.product(
        [None, False, True], TOP, [1, 3], [False, True]
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        body.update(n=n, temperature=0.7, seed=5)
        if logprobs is not None:
            body["logprobs"] = logprobs
        if top is not None:
            body["top_logprobs"] = top
        case = f"logprobs={logprobs} top_logprobs={top} n={n} stream={stream}"
        if top is not None and not logprobs:
            with pytest.raises(openai.BadRequestError) as info:
                _create(client, body, stream)
            assert info.value.body["param"] == "top_logprobs", case
            continue
        choices, completion_tokens = _create(client, body, stream)
        assert sorted(choices) == list(range(n)), case
        if not logprobs:
            assert all(entries is None for entries in choices.values()), case
            continue
        assert sum(len(e) for e in choices.values()) == completion_tokens, case
        for entries in choices.values():
            for e in entries:
                assert e.logprob <= 0 and len(e.top_logprobs) == (top or 0), case
                alternatives = [t.logprob for t in e.top_logprobs]
                assert alternatives == sorted(alternatives, reverse=True), case


def _create(client, body, stream):
    """``(index -> logprobs content or None, completion tokens)`` of a request."""
    if not stream:
        r = client.chat.completions.create(**body)
        choices = {
            c.index: (c.logprobs.content if c.logprobs is not None else None) for c in r.choices
        }
        return choices, r.usage.completion_tokens
    events = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **body
    )
    choices: dict[int, list | None] = {}
    usage = None
    for chunk in events:
        usage = chunk.usage or usage
        for c in chunk.choices:
            entries = choices.get(c.index)
            if c.logprobs is not None and c.logprobs.content:
                entries = (entries or []) + list(c.logprobs.content)
            choices[c.index] = entries
    return choices, usage.completion_tokens
