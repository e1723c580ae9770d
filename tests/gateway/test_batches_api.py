"""``/v1/batches`` through the openai SDK: lines answered as the endpoints answer them, failed
validation, per-line errors, cancel, tenants, usage rows with the batch id, restart-resume."""

import io
import json
import time
from datetime import timedelta

import openai
import pytest
from sqlalchemy import select

from loraplex.gateway.db.models import Batch, UsageEvent
from loraplex.gateway.db.session import db_url
from loraplex.gateway.db.types import utcnow
from tests.gateway.conftest import with_db
from tests.gateway.live import LiveGateway

TERMINAL = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id, content="hi", **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny-llava",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 5,
            "temperature": 0,
            **body,
        },
    }


def upload(client, lines):
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")


def wait(client, batch_id, statuses=TERMINAL, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or time.monotonic() > deadline:
            return batch
        time.sleep(0.05)


def records(client, file_id):
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def usage_rows(live, batch_id):
    with live.client(live.create_tenant(f"flush{time.monotonic_ns()}")["api_key"]) as c:
        c.get("/v1/usage")  # writes what is queued first

    async def body(sessions):
        async with sessions() as session:
            q = select(UsageEvent).where(UsageEvent.batch_id == batch_id)
            return list((await session.scalars(q)).all())

    return with_db(live.state.config.db_url, body)


def test_batch_answers_each_line_as_the_endpoint_does(live, client):
    lines = [
        chat_line("a", "hello"),
        chat_line("b", "tell me", max_tokens=3),
        chat_line("bad", bogus=1),  # the endpoint's own 400: an unknown field
    ]
    f = upload(client, lines)
    batch = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = wait(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (3, 2)
    assert batch.request_counts.failed == 1
    assert batch.completed_at and batch.finalizing_at and batch.in_progress_at
    out = records(client, batch.output_file_id)
    assert [r["custom_id"] for r in out] == ["a", "b"]
    for r, line in zip(out, lines, strict=False):
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["response"]["request_id"] == r["response"]["body"]["id"]
        direct = client.chat.completions.create(**line["body"])  # the interactive endpoint
        got = r["response"]["body"]
        assert got["object"] == "chat.completion"
        assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert got["usage"]["completion_tokens"] == direct.usage.completion_tokens
    (err,) = records(client, batch.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "bogus"
    out_file = client.files.retrieve(batch.output_file_id)
    assert out_file.purpose == "batch_output"
    rows = usage_rows(live, batch.id)
    assert sorted(r.status for r in rows) == ["error", "ok", "ok"]
    assert {r.key_id for r in rows} == {r.key_id for r in rows if r.key_id}  # the creator's key
    assert [b.id for b in client.batches.list()] == [batch.id]


def test_completions_endpoint_and_stream_refused_per_line(client):
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny-llava", "prompt": "once", "max_tokens": 3, "temperature": 0},
    }
    streamed = {**line, "custom_id": "s", "body": {**line["body"], "stream": True}}
    f = upload(client, [line, streamed])
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait(client, batch.id)
    (ok,) = records(client, batch.output_file_id)
    assert ok["response"]["body"]["object"] == "text_completion"
    (bad,) = records(client, batch.error_file_id)
    assert bad["custom_id"] == "s" and bad["response"]["body"]["error"]["param"] == "stream"


def test_malformed_lines_fail_validation_with_errors(client):
    f = upload(
        client,
        [
            chat_line("a"),
            "not json",
            chat_line("a"),  # duplicate custom_id
            {**chat_line("u"), "url": "/v1/embeddings"},
            {**chat_line("m"), "method": "GET"},
            {**chat_line("x"), "body": []},
        ],
    )
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait(client, batch.id)
    assert batch.status == "failed" and batch.failed_at
    errors = [(e.line, e.code) for e in batch.errors.data]
    assert errors == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "invalid_method"),
        (6, "invalid_body"),
    ]
    assert batch.output_file_id is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"extra_body": {"output_expires_after": {"seconds": 3600}}}, "output_expires_after"),
    ],
)
def test_bad_create_is_400_naming_the_field(client, fields, param):
    f = upload(client, [chat_line("a")])
    args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(**{**args, **fields})
    assert err.value.body["param"] == param


def test_another_tenants_batch_and_file_are_404(live, client):
    f = upload(client, [chat_line("a")])
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = live.openai(live.create_tenant("other")["api_key"])
    for call in (other.batches.retrieve, other.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert list(other.batches.list()) == []
    batch = wait(client, batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.output_file_id)
    with pytest.raises(openai.BadRequestError):  # a finished batch cannot be cancelled
        client.batches.cancel(batch.id)


def test_cancel_aborts_lines_in_flight(live, client):
    lines = [chat_line(f"c{i}", max_tokens=200, ignore_eos=True) for i in range(40)]
    f = upload(client, lines)
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait(client, batch.id, ("in_progress", *TERMINAL))
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed < 40
    rows = usage_rows(live, batch.id)
    assert rows and {r.status for r in rows} <= {"ok", "aborted"}


def test_list_pages_with_after_and_limit(client):
    f = upload(client, [chat_line("a")])
    ids = [
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    for batch_id in ids:
        wait(client, batch_id)


def start_partly_answered(gw, lines):
    """Create a tenant and a batch of ``lines``; return once 2 or more lines are answered.

    Returns:
        ``(api_key, batch, progress_path)``.
    """
    key = gw.create_tenant("t")["api_key"]
    client = gw.openai(key)
    batch = client.batches.create(
        input_file_id=upload(client, lines).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    progress = gw.state.config.files_dir / f"{batch.id}.progress"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # stop once some, not all, lines are answered
        if progress.exists() and 2 <= len(progress.read_bytes().splitlines()):
            break
        time.sleep(0.01)
    return key, batch, progress


def test_a_batch_survives_a_gateway_restart(engine_client, tmp_path):
    data = tmp_path / "data"
    lines = [chat_line(f"r{i}", f"line {i}", max_tokens=24, ignore_eos=True) for i in range(8)]
    with LiveGateway(engine_client, data, batch_concurrency=1) as gw:
        key, batch, progress = start_partly_answered(gw, lines)
        before = len(progress.read_bytes().splitlines())
    assert 2 <= before < 8
    with LiveGateway(engine_client, data, batch_concurrency=1) as gw:  # the same data dir
        client = gw.openai(key)
        batch = wait(client, batch.id)
        assert batch.status == "completed"
        out = records(client, batch.output_file_id)
        assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(8)]
        rows = usage_rows(gw, batch.id)
    assert sum(r.status == "ok" for r in rows) == 8  # nothing answered before was redone
    assert {r.status for r in rows} <= {"ok", "aborted"}


@pytest.mark.slow
def test_running_batch_slots_are_shared_across_tenants(engine_client, tmp_path):
    """One slot, tenant a queues three batches, then b one: b's runs second, not fourth."""
    with LiveGateway(
        engine_client, tmp_path / "data", batch_max_running=1, batch_concurrency=1
    ) as gw:
        a = gw.openai(gw.create_tenant("a")["api_key"])
        b = gw.openai(gw.create_tenant("b")["api_key"])
        long = [chat_line(f"l{i}", max_tokens=32, ignore_eos=True) for i in range(6)]
        short = [chat_line("s")]
        args = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
        first = a.batches.create(input_file_id=upload(a, long).id, **args)
        wait(a, first.id, ("in_progress", *TERMINAL))
        a_ids = [first.id] + [
            a.batches.create(input_file_id=upload(a, short).id, **args).id for _ in range(2)
        ]
        b_id = b.batches.create(input_file_id=upload(b, short).id, **args).id
        assert a.batches.retrieve(first.id).status == "in_progress"  # b queued while a1 runs
        done = [wait(a, i) for i in a_ids] + [wait(b, b_id)]

        async def started(sessions):  # the API's times are whole seconds; the rows' are not
            async with sessions() as session:
                rows = await session.scalars(select(Batch).order_by(Batch.in_progress_at))
                return [r.id for r in rows]

        order = with_db(gw.state.config.db_url, started)
    assert {x.status for x in done} == {"completed"}
    assert order == [a_ids[0], b_id, a_ids[1], a_ids[2]]  # FIFO would be a1, a2, a3, b1


def _rows_ok(rows):
    return sum(r.status == "ok" for r in rows), {r.status for r in rows}


@pytest.mark.slow
def test_two_gateways_on_one_database_never_both_run_a_batch(engine_client, tmp_path):
    """Both gateways sweep for unowned batches; each batch's lines still run exactly once."""
    data = tmp_path / "data"
    lines = [chat_line(f"r{i}", f"line {i}", max_tokens=8) for i in range(6)]
    opts = {"batch_concurrency": 1, "batch_lease_seconds": 0.6}
    with (
        LiveGateway(engine_client, data, **opts) as gw1,
        LiveGateway(engine_client, data, **opts) as gw2,
    ):
        key = gw1.create_tenant("t")["api_key"]
        c1, c2 = gw1.openai(key), gw2.openai(key)
        ids = [
            c1.batches.create(
                input_file_id=upload(c1, lines).id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            ).id
            for _ in range(3)
        ]
        done = [wait(c2, i) for i in ids]  # read through the other gateway
        rows = [usage_rows(gw1, i) for i in ids]
    assert [b.status for b in done] == ["completed"] * 3
    assert [_rows_ok(r) for r in rows] == [(6, {"ok"})] * 3  # never run twice, never aborted


@pytest.mark.slow
def test_a_crashed_gateways_batch_is_taken_over_when_its_lease_expires(engine_client, tmp_path):
    data = tmp_path / "data"
    lines = [chat_line(f"r{i}", f"line {i}", max_tokens=24, ignore_eos=True) for i in range(8)]
    with LiveGateway(engine_client, data, batch_concurrency=1) as gw:
        key, batch, progress = start_partly_answered(gw, lines)
    before = len(progress.read_bytes().splitlines())
    lease_end = time.monotonic() + 1.5

    async def crashed(sessions):  # as if the gateway had died holding the lease
        async with sessions() as session:
            row = await session.get(Batch, batch.id)
            row.owner, row.lease_expires_at = "crashed-gw", utcnow() + timedelta(seconds=1.5)
            await session.commit()

    with_db(db_url(data), crashed)
    with LiveGateway(engine_client, data, batch_concurrency=1, batch_lease_seconds=0.6) as gw:
        client = gw.openai(key)
        time.sleep(max(0.0, lease_end - time.monotonic() - 0.3))
        assert len(progress.read_bytes().splitlines()) == before  # not while the lease holds
        assert client.batches.retrieve(batch.id).status == "in_progress"
        batch = wait(client, batch.id)
        assert batch.status == "completed"
        assert [r["custom_id"] for r in records(client, batch.output_file_id)] == [
            f"r{i}" for i in range(8)
        ]
        rows = usage_rows(gw, batch.id)
    assert sum(r.status == "ok" for r in rows) == 8  # nothing answered before was redone


@pytest.mark.slow
def test_a_batch_past_its_completion_window_expires_as_openai_says(engine_client, tmp_path):
    """Answered lines stay in the output file; the rest go to the error file, batch_expired."""
    data = tmp_path / "data"
    lines = [chat_line(f"q{i}", max_tokens=4) for i in range(2)] + [
        chat_line(f"r{i}", f"line {i}", max_tokens=400, ignore_eos=True) for i in range(6)
    ]
    with LiveGateway(engine_client, data, batch_concurrency=1) as gw:
        key = gw.create_tenant("t")["api_key"]
        client = gw.openai(key)
        batch = client.batches.create(
            input_file_id=upload(client, lines).id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        progress = gw.state.config.files_dir / f"{batch.id}.progress"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the two short lines answered
            if progress.exists() and 2 <= len(progress.read_bytes().splitlines()):
                break
            time.sleep(0.01)

    async def window_ends_soon(sessions):  # as if it was created 24 h minus 1 s ago
        async with sessions() as session:
            row = await session.get(Batch, batch.id)
            row.expires_at = utcnow() + timedelta(seconds=1)
            await session.commit()

    with_db(db_url(data), window_ends_soon)
    with LiveGateway(engine_client, data, batch_concurrency=2) as gw:
        client = gw.openai(key)
        batch = wait(client, batch.id)
        out = records(client, batch.output_file_id)
        errors = records(client, batch.error_file_id)
        rows = usage_rows(gw, batch.id)
    assert batch.status == "expired" and batch.expired_at and batch.completed_at is None
    answered = [r["custom_id"] for r in out]
    assert answered[:2] == ["q0", "q1"] and all(r["response"]["status_code"] == 200 for r in out)
    assert len(answered) < 8  # the long lines could not all finish in a second
    ids = [line["custom_id"] for line in lines]
    assert [r["custom_id"] for r in errors] == [i for i in ids if i not in answered]
    for r in errors:
        assert r["response"] is None and r["error"]["code"] == "batch_expired"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (8, len(out), len(errors))
    assert sum(r.status == "ok" for r in rows) == len(out)
    # the two lines in flight when the window ended were aborted (the first stop aborts <= 1)
    assert sum(r.status == "aborted" for r in rows) >= 2
