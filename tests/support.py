"""Helpers every test folder uses (one copy each): a free port, polling for a condition."""

from __future__ import annotations

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
