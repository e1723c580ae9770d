"""A throwaway ``redis-server`` on loopback for the shared rate-limit tests.

Debian's ``redis-server`` (``.ci/run`` installs it); or ``LORAPLEX_TEST_REDIS_URL`` names a
Redis the tests may wipe. Without either the tests that need it are skipped.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    """A Redis URL for the duration of the block (a new server, or the configured one wiped).

    Raises:
        RuntimeError: the server did not answer within 10 s.
    """
    import pytest
    import redis

    given = os.environ.get("LORAPLEX_TEST_REDIS_URL")
    if given:
        redis.from_url(given).flushdb()
        yield given
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server (apt-get install redis-server) and no LORAPLEX_TEST_REDIS_URL")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
