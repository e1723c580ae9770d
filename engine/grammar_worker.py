"""A grammar sandbox worker: ``python -m loraplex.engine.grammar_worker``.

Runs in a process of its own (``engine.grammar_sandbox`` starts and kills it), with a memory
limit (``RLIMIT_AS``), no core dumps and a lower CPU priority, so that whatever the native
grammar compiler does with a client's schema (crash, allocate without end, spin) happens here
and not in the engine core. It imports llguidance and the standard library only (no torch), so
it starts in well under a second.

Protocol on stdin / stdout: frames of a 4-byte big-endian length and a msgpack map.

1. The parent sends ``{"tokenizer_json", "vocab_size", "eos_token_ids", "memory_bytes",
   "nice"}``; the worker applies the limits, indexes the tokenizer and answers
   ``{"ready": true}``.
2. Then, per job, ``{"kind", "value"}`` (a ``StructuredOutputSpec``) in, and
   ``{"ok": bool, "error": str, "seconds": float}`` out: ``ok`` when the spec compiles
   within the parser limits and its first token mask allows at least one id.

Anything written to file descriptor 1 by native code would corrupt the frames, so the protocol
keeps a private copy of it and fd 1 is pointed at stderr.
"""

from __future__ import annotations

import os
import resource
import struct
import sys
import time
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a tokenizer's JSON is a few MB; a job at most 64 KiB


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
    """Compile a spec as the engine would and take its first mask; the verdict as a dict.

    Args:
        compiler: An ``engine.structured_output.GrammarCompiler``.
        kind: The spec's kind.
        value: The spec's value.
    """
    from loraplex.engine.structured_output import (
        StructuredOutputError,
        StructuredOutputSpec,
        grammar_bitmask,
    )

    t0 = time.perf_counter()
    try:
        spec = StructuredOutputSpec(kind, value)
        matcher = compiler.matcher(spec)
    except (StructuredOutputError, ValueError) as exc:
        return {"ok": False, "error": str(exc), "seconds": time.perf_counter() - t0}
    mask = grammar_bitmask(matcher)
    if not allows_any(mask, compiler.vocab_size):
        return {
            "ok": False,
            "error": f"the {kind} allows no token: no output can ever match it",
            "seconds": time.perf_counter() - t0,
        }
    return {"ok": True, "error": "", "seconds": time.perf_counter() - t0}


def allows_any(mask: bytes, vocab_size: int) -> bool:
    """Whether a token bitmask (bit ``i % 8`` of byte ``i // 8``) allows an id < vocab_size."""
    full, rest = divmod(vocab_size, 8)
    if any(mask[:full]):
        return True
    return bool(rest and len(mask) > full and mask[full] & ((1 << rest) - 1))


def _limit(memory_bytes: int, nice: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if nice > 0:
        os.nice(nice)


def main() -> int:
    """Serve jobs until stdin closes; the exit status (0, or 2 for a broken protocol)."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    init = read_frame(stdin)
    if not isinstance(init, dict):
        return 2
    _limit(int(init.get("memory_bytes", 0)), int(init.get("nice", 0)))
    from loraplex.engine.structured_output import GrammarCompiler

    compiler = GrammarCompiler(
        init["tokenizer_json"], int(init["vocab_size"]), init["eos_token_ids"], max_cached=0
    )
    del init
    out.write(frame({"ready": True}))
    while True:
        job = read_frame(stdin)
        if job is None:
            return 0
        out.write(frame(vet(compiler, job["kind"], job["value"])))


if __name__ == "__main__":
    sys.exit(main())
