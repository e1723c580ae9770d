"""The access log of ``loraplex serve``: one line per request, in batches, keys never shown."""

import asyncio
import io
import re
from types import SimpleNamespace

import pytest

from loraplex.gateway.transport.access_log import AccessLog, access_line
from loraplex.gateway.transport.request_id import tag_response

SECRET = "lpx-" + "s3cr3t" * 6


def http_scope(path="/v1/models", query=b"", method="GET", **extra):
    return {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "path": path,
        "root_path": "",
        "query_string": query,
        "client": ("127.0.0.1", 5151),
        **extra,
    }


class CountingStream(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = 0

    def write(self, text):
        self.writes += 1
        return super().write(text)


def answer(status, body=b"ok"):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


def test_each_request_gets_one_line_written_in_one_batch():
    stream = CountingStream()

    async def main():
        log = AccessLog(answer(201), stream, flush_seconds=0.05)
        sent = []

        async def send(message):
            sent.append(message["type"])

        for path in ("/a", "/b", "/c"):
            await log(http_scope(path, method="POST"), None, send)
        assert stream.getvalue() == ""  # not yet: the batch waits for flush_seconds
        await asyncio.sleep(0.2)
        return log, sent

    log, sent = asyncio.run(main())
    lines = stream.getvalue().splitlines()
    assert [line.split('"')[1] for line in lines] == [f"POST /{p} HTTP/1.1" for p in "abc"]
    assert all(line.startswith("INFO:     127.0.0.1:5151 - ") for line in lines)
    assert all(line.split('" ')[1].split()[0] == "201" for line in lines)
    assert all(line.split()[-2].endswith("ms") for line in lines)
    assert all(re.fullmatch(r"request_id=[0-9a-f]{32}", line.split()[-1]) for line in lines)
    assert stream.writes == 1 and log.written == 3
    assert sent == ["http.response.start", "http.response.body"] * 3  # passed through


def test_a_full_batch_is_written_at_once_and_flush_writes_the_rest():
    stream = CountingStream()

    async def main():
        log = AccessLog(answer(200), stream, flush_seconds=60, max_lines=2)

        async def send(message):
            pass

        for _ in range(3):
            await log(http_scope(), None, send)
        assert stream.writes == 1 and len(stream.getvalue().splitlines()) == 2
        log.flush()  # what serve does after the server stops
        return log

    log = asyncio.run(main())
    assert stream.writes == 2 and log.written == 3 and not log._lines


def test_a_request_that_fails_before_answering_is_logged_with_no_status():
    stream = io.StringIO()

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    async def main():
        log = AccessLog(broken, stream)
        with pytest.raises(RuntimeError):
            await log(http_scope("/v1/chat/completions", method="POST"), None, None)
        log.flush()

    asyncio.run(main())
    (line,) = stream.getvalue().splitlines()
    assert '"POST /v1/chat/completions HTTP/1.1" - ' in line


def test_other_scopes_pass_through_without_a_line():
    stream = io.StringIO()
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    async def main():
        log = AccessLog(app, stream)
        await log({"type": "lifespan"}, None, None)
        log.flush()

    asyncio.run(main())
    assert seen == ["lifespan"] and stream.getvalue() == ""


def test_a_broken_stream_drops_lines_without_failing_requests():
    class Broken(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

    async def main():
        log = AccessLog(answer(200), Broken(), max_lines=1)

        async def send(message):
            pass

        await log(http_scope(), None, send)
        return log

    log = asyncio.run(main())
    assert (log.written, log.dropped) == (0, 1)


@pytest.mark.parametrize(
    ("path", "query"),
    [
        (f"/v1/x/{SECRET}", b""),
        ("/v1/models", f"api_key={SECRET}".encode()),
        ("/v1/models", ("k=" + "".join(f"%{b:02X}" for b in SECRET.encode())).encode()),
        ("/v1/models", f"auth=Bearer+{'t0ps3cret' * 3}".encode()),
    ],
)
def test_keys_in_the_target_are_masked_even_percent_encoded(path, query):
    line = access_line(http_scope(path, query), 200, 0.001)
    assert "s3cr3t" not in line and "t0ps3cret" not in line, line
    assert "***" in line and " 1.0ms request_id=" in line


def test_a_crafted_target_cannot_forge_a_second_line():
    line = access_line(http_scope("/x\n" + 'INFO: 1.2.3.4 - "GET /admin" 200', b""), 404, 0.0)
    assert line.count("\n") == 1 and line.endswith("\n") and "\\n" in line


def test_the_tenant_is_named_when_a_key_named_one():
    user = SimpleNamespace(tenant_id="t-123")
    line = access_line(http_scope(user=user), 200, 0.0)
    assert re.search(r" 0\.0ms request_id=[0-9a-f]{32} tenant=t-123\n$", line)
    assert "tenant=" not in access_line(http_scope(), 401, 0.0)


def test_the_line_names_the_id_the_response_carried():
    stream = io.StringIO()
    sent = []

    async def tagging(scope, receive, send):
        async def tagged(message):
            tag_response(message, scope)
            await send(message)

        await answer(200)(scope, receive, tagged)

    async def send(message):
        sent.append(message)

    async def main():
        log = AccessLog(tagging, stream)
        await log(http_scope(headers=[(b"x-request-id", b"job-1:a")]), None, send)
        await log(http_scope(headers=[(b"x-request-id", b"bad id")]), None, send)
        log.flush()

    asyncio.run(main())
    mine, generated = (dict(m["headers"])[b"x-request-id"].decode() for m in sent[::2])
    assert mine == "job-1:a" and re.fullmatch(r"[0-9a-f]{32}", generated)
    lines = stream.getvalue().splitlines()
    assert [line.split()[-1] for line in lines] == [f"request_id={i}" for i in (mine, generated)]
