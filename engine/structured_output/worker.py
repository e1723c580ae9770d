"""A grammar sandbox worker: ``python -m loraplex.engine.structured_output.worker``.

Runs in a process of its own (``engine.structured_output.sandbox`` starts and kills it), with a
memory limit (``RLIMIT_AS``), no core dumps and a lower CPU priority, so that whatever the native
grammar compiler does with a client's schema (crash, allocate without end, spin) happens here
and not in the engine core. It imports llguidance and the standard library only (no torch), so
it starts in well under a second.

Protocol on stdin / stdout: frames of a 4-byte big-endian length and a msgpack map.

1. The parent sends ``{"tokenizer_json", "vocab_size", "eos_token_ids", "memory_bytes",
   "nice"}``; the worker applies the limits (and asks the kernel to kill it when its parent
   thread dies), indexes the tokenizer and answers ``{"ready": true}``.
2. Then, per job, ``{"kind", "value"}`` (a ``StructuredOutputSpec``) in, and
   ``{"ok": bool, "error": str, "seconds": float}`` out (:func:`vet`). Each job runs on a
   thread with an explicit stack of :data:`COMPILE_STACK_BYTES`.

Anything written to file descriptor 1 by native code would corrupt the frames, so the protocol
keeps a private copy of it and fd 1 is pointed at stderr.
"""

from __future__ import annotations

import os
import resource
import signal
import struct
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a tokenizer's JSON is a few MB; a job at most 64 KiB
MAX_MASK_CPU_S = 0.05  # a token mask costing more stalls every step of the core: refused
COMPILE_STACK_BYTES = 8 * 1024 * 1024
"""The stack a job runs on here; the core compiles on a thread with 8 times this
(``engine.structured_output.manager``), so a recursion that fits here cannot overflow there."""


def read_frame(stream: BinaryIO) -> Any:
    """One msgpack frame from ``stream``; None at end of file.

    Raises:
        ValueError: a frame longer than :data:`MAX_FRAME_BYTES` or cut short.
    """
    import msgpack

    head = stream.read(_HEADER.size)
    if not head:
        return None
    if len(head) < _HEADER.size:
        raise ValueError("a frame header was cut short")
    (size,) = _HEADER.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes")
    body = stream.read(size)
    if len(body) < size:
        raise ValueError("a frame was cut short")
    return msgpack.unpackb(body, raw=False)


def frame(obj: Any) -> bytes:
    """``obj`` as one frame (length prefix and msgpack)."""
    import msgpack

    body = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def vet(compiler: Any, kind: str, value: str) -> dict[str, Any]:
    """Check a spec as the engine would meet it; the verdict as a dict.

    The spec's shape (``engine.structured_output.bounds``), its compilation (as the engine compiles
    it), its first token mask, then one step of decoding: the first id the mask allows (EOS when it
    is the only one) is consumed and the next mask taken, on a grammar that has not finished.
    That step is where a lexer past llguidance's limits fails ("too many expressions"), which
    would otherwise end the request with an error after it was admitted; and the second mask's
    CPU time is held to :data:`MAX_MASK_CPU_S` (the core computes every mask on its step).

    Args:
        compiler: An ``engine.structured_output.grammar.GrammarCompiler``.
        kind: The spec's kind.
        value: The spec's value.
    """
    from loraplex.engine.structured_output.grammar import (
        StructuredOutputError,
        StructuredOutputSpec,
        grammar_bitmask,
    )

    t0 = time.perf_counter()

    def refuse(error: str) -> dict[str, Any]:
        return {"ok": False, "error": error, "seconds": time.perf_counter() - t0}

    try:
        spec = StructuredOutputSpec(kind, value).check_bounds()
        matcher = compiler.matcher(spec)
    except (StructuredOutputError, ValueError) as exc:
        return refuse(str(exc))
    mask = grammar_bitmask(matcher)
    first = first_allowed(mask, compiler.vocab_size, compiler.eos_token_ids)
    if first is None:
        return refuse(f"the {kind} allows no token: no output can ever match it")
    if not matcher.consume_token(first) or matcher.is_error():
        return refuse(f"the {kind} cannot be enforced past its first token (parser limits)")
    if not matcher.is_stopped():
        cpu0 = time.thread_time()
        mask = grammar_bitmask(matcher)
        cpu = time.thread_time() - cpu0
        if first_allowed(mask, compiler.vocab_size, ()) is None:
            return refuse(f"the {kind} cannot be enforced past its first token (parser limits)")
        if cpu > MAX_MASK_CPU_S:
            return refuse(
                f"the {kind} costs {cpu * 1000:.0f} ms of CPU per token to enforce; at most "
                f"{MAX_MASK_CPU_S * 1000:.0f}"
            )
    return {"ok": True, "error": "", "seconds": time.perf_counter() - t0}


def first_allowed(mask: bytes, vocab_size: int, last: Iterable[int]) -> int | None:
    """The first id < ``vocab_size`` a token bitmask allows (bit ``i % 8`` of byte ``i // 8``).

    Ids in ``last`` (the EOS ids) are taken only when nothing else is allowed; None when
    nothing is.
    """
    later = set(last)
    fallback = None
    for index, byte in enumerate(mask[: -(-vocab_size // 8)]):
        while byte:
            low = byte & -byte
            token = index * 8 + low.bit_length() - 1
            if token >= vocab_size:
                return fallback
            if token not in later:
                return token
            fallback = token if fallback is None else fallback
            byte ^= low
    return fallback


def allows_any(mask: bytes, vocab_size: int) -> bool:
    """Whether a token bitmask (bit ``i % 8`` of byte ``i // 8``) allows an id < vocab_size."""
    return first_allowed(mask, vocab_size, ()) is not None


def _limit(memory_bytes: int, nice: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if nice > 0:
        os.nice(nice)
    try:  # Linux: die with the thread that started us (the sandbox), never outlive the core
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _on_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a new thread of :data:`COMPILE_STACK_BYTES` of stack; its result."""
    result: list[Any] = []
    old = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        thread = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
        thread.start()
    finally:
        threading.stack_size(old)
    thread.join()
    return result[0]


def main() -> int:
    """Serve jobs until stdin closes; the exit status (0, or 2 for a broken protocol)."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    init = read_frame(stdin)
    if not isinstance(init, dict):
        return 2
    _limit(int(init.get("memory_bytes", 0)), int(init.get("nice", 0)))
    from loraplex.engine.structured_output.grammar import GrammarCompiler

    compiler = GrammarCompiler(
        init["tokenizer_json"], int(init["vocab_size"]), init["eos_token_ids"], max_cached=0
    )
    del init
    out.write(frame({"ready": True}))
    while True:
        job = read_frame(stdin)
        if job is None:
            return 0
        out.write(frame(_on_thread(vet, compiler, job["kind"], job["value"])))


if __name__ == "__main__":
    sys.exit(main())
