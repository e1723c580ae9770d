"""Breadcrumbs: which request the engine core is running native code for, readable after a crash.

A native fault (SIGSEGV, an abort) ends a process without a word; what it was doing is lost.
Before each call into native code on one request's behalf (a grammar's token mask, a token
consumed by its matcher, a matcher copied, a grammar compiled), the core writes that request's
id into a small file mapped into its memory (``MAP_SHARED``), and clears it after. The stores
are plain memory writes (no system call, ~0.2 us); the kernel keeps the page when the process
dies, so the core client (``engine.client.process``) reads the slot after a death and knows the
culprit for certain (``engine.client.quarantine``: refused from the first death, not the second).

Two slots, one per thread that calls native code on a request's behalf: :data:`STEP` (the
core's step thread) and :data:`COMPILE` (its grammar compile thread). Each slot is a 4-byte
length and up to :data:`SLOT_BYTES` - 4 bytes of the request id (UTF-8, cut). A fault in the
batched forward pass belongs to no one request and leaves the slots empty: the client falls
back to its suspects.

The same idea as a flight recorder's last entry (Chromium's crash keys, Linux's pstore).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STEP, COMPILE = 0, 1
SLOTS = 2
SLOT_BYTES = 256
_LENGTH = struct.Struct("<I")


class Breadcrumb:
    """The core's side: write and clear slots of the file at ``path`` (None: do nothing).

    Args:
        path: The file the client made with :func:`create` (``LORAPLEX_CORE_BREADCRUMB``).
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self._map: mmap.mmap | None = None
        if path is not None:
            with open(path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), SLOTS * SLOT_BYTES)

    def set(self, slot: int, request_id: str) -> None:
        """Say that ``slot``'s thread now runs native code for ``request_id``."""
        if self._map is None:
            return
        data = request_id.encode("utf-8", "replace")[: SLOT_BYTES - _LENGTH.size]
        start = slot * SLOT_BYTES
        self._map[start + _LENGTH.size : start + _LENGTH.size + len(data)] = data
        self._map[start : start + _LENGTH.size] = _LENGTH.pack(len(data))  # length last

    def clear(self, slot: int) -> None:
        """Say that ``slot``'s thread is done with it."""
        if self._map is not None:
            start = slot * SLOT_BYTES
            self._map[start : start + _LENGTH.size] = _LENGTH.pack(0)

    @contextmanager
    def on(self, slot: int, request_id: str) -> Iterator[None]:
        """``set`` for the ``with`` block, then ``clear`` (also when it raises)."""
        self.set(slot, request_id)
        try:
            yield
        finally:
            self.clear(slot)


def create(path: str | os.PathLike) -> Path:
    """Make an empty breadcrumb file for a core to map (the client, before the core starts)."""
    path = Path(path)
    path.write_bytes(b"\0" * (SLOTS * SLOT_BYTES))
    return path


def read(path: str | os.PathLike) -> list[str]:
    """The request ids in the slots of a (dead) core's file; empty slots left out.

    Returns:
        At most :data:`SLOTS` ids; none when the file is missing or unreadable.
    """
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    ids = []
    for slot in range(SLOTS):
        start = slot * SLOT_BYTES
        if len(data) < start + SLOT_BYTES:
            break
        (length,) = _LENGTH.unpack_from(data, start)
        if 0 < length <= SLOT_BYTES - _LENGTH.size:
            body = data[start + _LENGTH.size : start + _LENGTH.size + length]
            ids.append(body.decode("utf-8", "replace"))
    return ids
