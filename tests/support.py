"""Helpers every test folder uses (one copy each): a free port, polling for a condition, marks
that pick the test device."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (free when asked; a server binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``predicate()`` until it returns something truthy, at most ``timeout`` seconds.

    Returns:
        That value, or the last (falsy) one when the time ran out: a hang guard, not a timing
        assertion.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# The suite's device (tests/conftest.py reads the same variable), for marks decided at collection.
ON_CUDA = os.environ.get("LORAPLEX_TEST_DEVICE", "cpu") == "cuda"


def cuda_only(reason: str):
    """Skip a test unless ``LORAPLEX_TEST_DEVICE=cuda`` (e.g. shapes the interpreter is too slow
    for); ``reason`` says why it needs the GPU."""
    import pytest

    return pytest.mark.skipif(
        not ON_CUDA, reason=f"CUDA only (LORAPLEX_TEST_DEVICE=cuda): {reason}"
    )
