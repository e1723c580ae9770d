"""SSE chunks: outputs the engine already produced go out in one write, the events unchanged."""

import asyncio
import json
from types import SimpleNamespace

from loraplex.engine.request import CompletionOutput, RequestOutput
from loraplex.gateway.domains.chat.streaming import StreamMeta, chunk_stream
from loraplex.gateway.errors import APIError

TOKENS = 4


def outputs() -> list[RequestOutput]:
    outs = []
    for step in range(1, TOKENS + 1):
        last = step == TOKENS
        choice = CompletionOutput(  # DELTA: what the step added
            index=0,
            text="ab",
            token_ids=[7],
            finish_reason="length" if last else None,
            num_tokens=step,
        )
        outs.append(RequestOutput("r", [1, 2, 3], [choice], finished=last, num_cached_tokens=0))
    return outs


class QueueRun:
    """What chunk_stream reads of a ChatRun: next, next_nowait, cancel, the ledger's counts."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ledger = SimpleNamespace(prompt_tokens=3, completion_tokens=TOKENS, cached_tokens=0)
        self.cancelled: list[str] = []
        self.durable_waits: list[bool] = []
        self.not_durable: APIError | None = None

    async def next(self):
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def next_nowait(self):
        if self.queue.empty():
            return None
        item = self.queue.get_nowait()
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self, reason: str) -> None:
        self.cancelled.append(reason)

    async def durable(self, strict: bool = True) -> None:
        self.durable_waits.append(strict)
        if self.not_durable is not None and strict:
            raise self.not_durable


META = StreamMeta("chatcmpl-1", 0, "m", 1, True, False, lambda ids: ["x"] * len(ids))


def events(body: bytes) -> list:
    assert body.endswith(b"\n\n")
    found = []
    for event in body.decode().split("\n\n")[:-1]:
        assert event.startswith("data: ")
        data = event[len("data: ") :]
        found.append(data if data == "[DONE]" else json.loads(data))
    return found


async def collect(run: QueueRun, first: RequestOutput, feed=None) -> list[bytes]:
    chunks = []
    feeder = asyncio.ensure_future(feed()) if feed else None
    async for chunk in chunk_stream(run, first, META):
        chunks.append(chunk)
    if feeder:
        await feeder
    return chunks


def test_ready_outputs_go_in_one_write_and_slow_ones_one_each():
    async def main():
        outs = outputs()
        burst = QueueRun()
        for out in outs[1:]:
            burst.queue.put_nowait(out)
        together = await collect(burst, outs[0])

        slow = QueueRun()

        async def feed():
            for out in outs[1:]:
                await asyncio.sleep(0.01)
                slow.queue.put_nowait(out)

        apart = await collect(slow, outs[0], feed)
        return together, apart, burst, slow

    together, apart, burst, slow = asyncio.run(main())
    assert len(together) == 1
    assert len(apart) == TOKENS  # one write per output as it arrives; the last carries DONE
    assert b"".join(together) == b"".join(apart)
    got = events(together[0])
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"]["content"] for e in got[1 : 1 + TOKENS]] == ["ab"] * TOKENS
    assert got[TOKENS]["choices"][0]["finish_reason"] == "length"
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == TOKENS
    assert got[-1] == "[DONE]"
    assert burst.cancelled == slow.cancelled == ["client_disconnected"]  # no-op on a done run
    assert burst.durable_waits == slow.durable_waits == [True]  # before the last write


def test_a_row_that_cannot_be_made_durable_ends_the_stream_with_an_error():
    """The finish chunk is not the end: an error event says the answer is not complete."""

    async def main():
        outs = outputs()
        run = QueueRun()
        run.not_durable = APIError(503, "usage cannot be recorded", code="usage_unavailable")
        for out in outs[1:]:
            run.queue.put_nowait(out)
        return await collect(run, outs[0]), run

    chunks, run = asyncio.run(main())
    got = events(b"".join(chunks))
    assert got[-1] == "[DONE]"
    assert got[-2] == {
        "error": {
            "message": "usage cannot be recorded",
            "type": "service_unavailable",
            "param": None,
            "code": "usage_unavailable",
        }
    }
    assert run.durable_waits == [True]


def test_an_error_after_ready_outputs_follows_them():
    async def main():
        outs = outputs()
        run = QueueRun()
        run.queue.put_nowait(outs[1])
        run.queue.put_nowait(APIError(503, "the engine is not running", code="engine_unavailable"))
        return await collect(run, outs[0])

    chunks = asyncio.run(main())
    assert len(chunks) == 1
    got = events(chunks[0])
    assert [e["choices"][0]["delta"].get("content") for e in got[1:3]] == ["ab", "ab"]
    assert got[3]["error"]["code"] == "engine_unavailable" and got[4] == "[DONE]"


def test_chunk_encoder_gives_the_bytes_of_the_plain_encoding():
    from loraplex.gateway.domains.chat.streaming import ChunkEncoder, chunk_body, sse

    choices = [
        {
            "index": 0,
            "delta": {"content": 'a "quoted" \\ line\n\x00'},
            "logprobs": None,
            "finish_reason": None,
        },
        {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"},
    ]
    for model in ("m", 'we"ird\n', "\x00choices\x00", "ünï"):
        for include_usage in (True, False):
            meta = StreamMeta("chatcmpl-9", 17, model, 2, include_usage, False, lambda i: [])
            encoder = ChunkEncoder(meta)
            for c in ([], choices[:1], choices):
                assert encoder.encode(c) == sse(chunk_body(meta, c))
            for text in ("ok ", "", 'a "q" \\ \n \x00 ü'):
                plain = [{"index": 0, "delta": {"content": text}, "logprobs": None,
                          "finish_reason": None}]  # fmt: skip
                assert encoder.content0(text) == sse(chunk_body(meta, plain))


def test_the_per_token_fast_path_sends_the_events_of_the_general_path():
    """n=1 without logprobs encodes only each token's text; logprobs asked for (but none come)
    takes the general per-choice path: the bytes must be the same."""
    from dataclasses import replace

    async def body(meta):
        outs = outputs()
        run = QueueRun()
        for out in outs[1:]:
            run.queue.put_nowait(out)
        chunks = []
        async for chunk in chunk_stream(run, outs[0], meta):
            chunks.append(chunk)
        return b"".join(chunks)

    fast = asyncio.run(body(META))
    general = asyncio.run(body(replace(META, want_logprobs=True)))
    assert fast == general and fast.count(b"data: ") == TOKENS + 3
