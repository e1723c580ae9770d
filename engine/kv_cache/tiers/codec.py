"""The framed record of the tiers that serialise blocks (disk, remote): a header, then the payload.

Header (little-endian, 60 bytes, then the key): magic ``b"LPKV"``, format version (u16), flags
(u16, 0), the layout's fingerprint (32 raw bytes), key length (u16), reserved (u16, 0), payload
length (u64), XXH3-64 of the payload (u64). The checksum is XXH3-64 (the ``xxhash`` package the
block hasher already uses): ~130 GB/s on a cached block here against 7 GB/s for ``zlib.crc32``
and 2 GB/s for SHA-256 (``bench.kv_shared_tier``, docs/kv_tiers.md), so verifying a block costs
less than copying it. It detects corruption and truncation, not forgery: the store is trusted.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

from loraplex.engine.kv_cache.tiers.layout import FORMAT_VERSION, KVLayout

MAGIC = b"LPKV"
_HEADER = struct.Struct("<4sHH32sHHQQ")
HEADER_NBYTES = _HEADER.size
MAX_KEY_NBYTES = 64  # block hashes are 16 or 32 bytes; 128 hex digits fit a file name


class CorruptBlock(Exception):
    """A record that is not the block asked for; it must be dropped, never served.

    Bad magic, version, fingerprint, key, length or checksum, or a truncated record.
    """


def frame_nbytes(key_nbytes: int, layout: KVLayout) -> int:
    """Bytes of a record of a key of ``key_nbytes`` bytes in ``layout``."""
    return HEADER_NBYTES + key_nbytes + layout.block_nbytes


def check_payload(payload: torch.Tensor, layout: KVLayout | None = None) -> None:
    """Check that ``payload`` is a block payload: contiguous 1-D uint8 on the CPU.

    Args:
        payload: The tensor to check.
        layout: When given, its ``block_nbytes`` must be the payload's length.

    Raises:
        ValueError: it is not.
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        raise ValueError("a KV block payload is a torch.uint8 tensor")
    if payload.dim() != 1 or payload.device.type != "cpu" or not payload.is_contiguous():
        raise ValueError("a KV block payload is a contiguous 1-D CPU tensor")
    if layout is not None and payload.numel() != layout.block_nbytes:
        raise ValueError(
            f"payload of {payload.numel()} bytes, the layout's blocks have {layout.block_nbytes}"
        )


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_NBYTES:
        raise ValueError(f"a block key is 1 to {MAX_KEY_NBYTES} bytes")


def payload_view(payload: torch.Tensor) -> memoryview:
    """The payload's buffer, without a copy (for ``file.write``, sockets, checksums)."""
    return memoryview(payload.numpy()).cast("B")


def header(key: bytes, payload: torch.Tensor, layout: KVLayout) -> bytes:
    """The header and key that precede ``payload`` in its record.

    Args:
        key: The block hash.
        payload: The block, ``layout.block_nbytes`` uint8 bytes (see ``check_payload``).
        layout: The layout the block belongs to.

    Raises:
        ValueError: a malformed key or payload.
    """
    _check_key(key)
    check_payload(payload, layout)
    digest = xxhash.xxh3_64_intdigest(payload_view(payload))
    fields = (
        MAGIC,
        FORMAT_VERSION,
        0,
        layout.fingerprint_digest,
        len(key),
        0,
        payload.numel(),
        digest,
    )
    return _HEADER.pack(*fields) + key


def encode(key: bytes, payload: torch.Tensor, layout: KVLayout) -> bytes:
    """The whole record as one ``bytes`` (one copy of the payload; for stores that take one value).

    Raises:
        ValueError: a malformed key or payload.
    """
    return b"".join((header(key, payload, layout), payload_view(payload)))


def decode(frame: bytes | bytearray | memoryview, key: bytes, layout: KVLayout) -> torch.Tensor:
    """The payload of a record, verified to be ``key``'s block in ``layout``.

    A writable buffer (``bytearray``) is wrapped without a copy (``torch.frombuffer``); a
    read-only one (``bytes``) is copied once into a new tensor.

    Args:
        frame: The record's bytes.
        key: The block hash asked for.
        layout: The layout of the reader.

    Returns:
        The payload, a contiguous 1-D ``torch.uint8`` tensor of ``layout.block_nbytes`` bytes.

    Raises:
        CorruptBlock: bad magic, version, flags, fingerprint, key, length or checksum; truncated
            or trailing bytes.
    """
    view = memoryview(frame).cast("B")
    if len(view) < HEADER_NBYTES:
        raise CorruptBlock(f"truncated header ({len(view)} bytes)")
    magic, version, flags, fp, key_len, reserved, length, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != FORMAT_VERSION or flags or reserved:
        raise CorruptBlock(f"unsupported format version {version}")
    if fp != layout.fingerprint_digest:
        raise CorruptBlock("record of another layout (fingerprint differs)")
    if key_len != len(key) or view[HEADER_NBYTES : HEADER_NBYTES + key_len] != key:
        raise CorruptBlock("record of another key")
    if length != layout.block_nbytes:
        raise CorruptBlock(f"payload length {length}, expected {layout.block_nbytes}")
    start = HEADER_NBYTES + key_len
    if len(view) != start + length:
        raise CorruptBlock(f"record of {len(view)} bytes, expected {start + length}")
    body = view[start:]
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise CorruptBlock("checksum mismatch")
    if view.readonly:
        out = torch.empty(length, dtype=torch.uint8)
        out.numpy()[:] = np.frombuffer(body, dtype=np.uint8)
        return out
    return torch.frombuffer(body, dtype=torch.uint8)
