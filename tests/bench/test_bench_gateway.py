"""bench.gateway's load client: the lean HTTP/1.1 client, against the real app and a raw server."""

import asyncio
import json

import httpx
import pytest

from bench.gateway import MAX_TOKENS, gateway_call, health_call, open_client
from bench.http_client import LeanHTTPClient
from tests.gateway.live import instant_gateway

pytestmark = pytest.mark.slow


@pytest.fixture
def gw(tmp_path):
    with instant_gateway(tmp_path / "data", completion_tokens=MAX_TOKENS) as live:
        yield live


def test_bench_calls_get_whole_answers_over_one_connection(gw):
    created = httpx.post(
        f"{gw.base_url}/admin/tenants",
        json={"name": "bench"},
        headers={"Authorization": f"Bearer {gw.admin_key}"},
    )
    assert created.status_code == 201
    key = created.json()["api_key"]

    async def main():
        client = await open_client(gw.port, key)
        try:
            for _ in range(3):  # keep-alive: every request on the same connection
                await gateway_call(client, stream=True)()
                await gateway_call(client, stream=False)()
                await health_call(client)()
            streamed = await client.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(
                    {
                        "model": "instant",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 3,
                        "stream": True,
                    }
                ).encode(),
                "application/json",
            )
            refused = await client.request("POST", "/v1/chat/completions", b"{", "application/json")
        finally:
            await client.close()
        wrong = LeanHTTPClient("127.0.0.1", gw.port, [("Authorization", "Bearer lpx-nope")])
        await wrong.connect()
        try:
            unauthorized = await wrong.request("GET", "/v1/usage")
        finally:
            await wrong.close()
        return streamed, refused, unauthorized

    streamed, refused, unauthorized = asyncio.run(main())
    assert streamed.status == 200
    assert streamed.header("Content-Type").startswith(b"text/event-stream")
    events = [e for e in streamed.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ok " * 3
    assert refused.status == 400 and json.loads(refused.body)["error"]["type"]
    assert unauthorized.status == 401 and json.loads(unauthorized.body)["error"]


async def _raw_server(respond):
    """A loopback server answering each connection with ``respond(reader, writer)``."""

    async def handle(reader, writer):
        try:
            await respond(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def test_lean_client_reassembles_chunked_and_sized_bodies_sent_in_pieces():
    async def respond(reader, writer):
        head, body = await _read_request(reader)
        assert head.startswith(b"POST /x HTTP/1.1\r\n") and b"X-Token: t\r\n" in head
        assert body == b"payload"
        answer = (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )
        for i in range(len(answer)):  # one byte per write: every split point
            writer.write(answer[i : i + 1])
            await writer.drain()
        await _read_request(reader)
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\nX-A: b\r\n\r\nnope")
        await writer.drain()
        await reader.read()  # until the client closes

    async def main():
        server, port = await _raw_server(respond)
        client = LeanHTTPClient("127.0.0.1", port, [("X-Token", "t")])
        await client.connect()
        try:
            first = await client.request("POST", "/x", b"payload")
            second = await client.request("GET", "/y")
        finally:
            await client.close()
            server.close()
        return first, second

    first, second = asyncio.run(main())
    assert (first.status, first.body) == (200, b"hello world")
    assert (second.status, second.body, second.header("x-a")) == (404, b"nope", b"b")


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # closed mid-body
        b"NOT HTTP AT ALL\r\n\r\n",  # not a response
        b"",  # closed before answering
    ],
)
def test_lean_client_fails_clearly_when_the_answer_is_cut_or_malformed(answer):
    async def respond(reader, writer):
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()

    async def main():
        server, port = await _raw_server(respond)
        client = LeanHTTPClient("127.0.0.1", port)
        await client.connect()
        try:
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(client.request("GET", "/"), timeout=10)
            with pytest.raises(ConnectionError):  # the connection is not reused after that
                await client.request("GET", "/")
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


def test_lean_client_refuses_misuse():
    async def main():
        client = LeanHTTPClient("127.0.0.1", 9)
        with pytest.raises(ConnectionError):  # never connected
            await client.request("GET", "/")

        async def respond(reader, writer):
            await _read_request(reader)
            await asyncio.sleep(0.2)
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

        server, port = await _raw_server(respond)
        client = LeanHTTPClient("127.0.0.1", port)
        await client.connect()
        try:
            first = asyncio.ensure_future(client.request("GET", "/"))
            await asyncio.sleep(0.05)
            with pytest.raises(RuntimeError):  # one request at a time
                await client.request("GET", "/")
            assert (await first).status == 204
        finally:
            await client.close()
            server.close()

    asyncio.run(main())
