"""GracefulServer freezes the start-up heap before serving (no full-collection pauses)."""

import gc
import logging

import uvicorn

from gateway.server.graceful import GracefulServer, freeze_startup_heap


async def _app(scope, receive, send):  # never called
    raise AssertionError


def test_run_freezes_the_heap_before_serving(monkeypatch):
    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(sockets))
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        config = uvicorn.Config(_app)  # configures uvicorn's loggers
        access = logging.getLogger("uvicorn.access")
        before = list(access.handlers)
        GracefulServer(config, state=object()).run()
        assert seen == [None]
        assert access.handlers == before  # the access log's thread is gone, its handlers back
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


def test_access_log_is_written_from_a_thread_with_the_same_text(monkeypatch):
    """uvicorn's access lines keep their format (and redaction) when moved off the loop."""
    import io
    import logging
    import threading

    from gateway.auth.redact import RedactingFilter
    from gateway.server.graceful import log_from_a_thread

    uvicorn.Config(_app, log_level="info")  # uvicorn's own logging setup
    logger = logging.getLogger("uvicorn.access")
    before = list(logger.handlers)
    sink = io.StringIO()
    writers = []

    class Sink(logging.StreamHandler):
        def emit(self, record):
            writers.append(threading.current_thread().name)
            super().emit(record)

    handler = Sink(sink)
    handler.setFormatter(logger.handlers[0].formatter)  # uvicorn's AccessFormatter
    logger.handlers = [handler]
    logger.addFilter(RedactingFilter())
    try:
        listener = log_from_a_thread("uvicorn.access")
        assert listener is not None and log_from_a_thread("uvicorn.access") is None
        logger.info(
            '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/v1/x?k=lpx-secretsecret", "1.1", 200
        )
        listener.stop()
    finally:
        logger.handlers = before
        logger.filters = [f for f in logger.filters if not isinstance(f, RedactingFilter)]
    line = sink.getvalue()
    assert '127.0.0.1:5 - "GET /v1/x?k=lpx-' in line and "200" in line, line
    assert "secretsecret" not in line  # redacted before it was queued
    assert writers and threading.main_thread().name not in writers
