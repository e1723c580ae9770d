"""GracefulServer freezes the start-up heap before serving (no full-collection pauses)."""

import gc

import pytest
import uvicorn

from loraplex.gateway.transport.graceful import GracefulServer, freeze_startup_heap


async def _app(scope, receive, send):  # never called
    raise AssertionError


def test_run_freezes_the_heap_before_serving(monkeypatch):
    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(sockets))
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        GracefulServer(uvicorn.Config(_app), state=object()).run()
        assert seen == [None]
        assert gc.get_freeze_count() > 1000  # everything this test process had loaded
    finally:
        gc.unfreeze()


def test_objects_made_after_the_freeze_are_still_collected():
    gc.unfreeze()
    try:
        frozen = freeze_startup_heap()
        assert frozen > 0 and gc.get_freeze_count() > 0
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # the new cycle is found; the frozen heap is not walked
        assert gc.get_freeze_count() > 0  # still frozen (frozen objects freed by refcount leave)
    finally:
        gc.unfreeze()


def test_run_writes_the_access_logs_last_lines_when_the_server_ends(monkeypatch):
    import asyncio
    import io

    from loraplex.gateway.transport.access_log import AccessLog

    stream = io.StringIO()
    access = AccessLog(_app, stream, flush_seconds=60)

    async def answer_a_request():
        access.add("INFO:     a line still in memory\n")  # its write is 60 s away

    def serve(self, sockets=None):
        asyncio.run(answer_a_request())
        raise KeyboardInterrupt  # the server ending, however it ends

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    gc.unfreeze()
    try:
        with pytest.raises(KeyboardInterrupt):
            GracefulServer(uvicorn.Config(access), state=object()).run()
    finally:
        gc.unfreeze()
    assert stream.getvalue() == "INFO:     a line still in memory\n"
