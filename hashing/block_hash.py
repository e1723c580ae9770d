"""The block hash: the identity of one full KV block for automatic prefix caching.

A block's hash covers its parent's hash (so, through the chain, every token before it), its own
token ids and its *extra keys* (the LoRA adapter, the images overlapping it, the cache salt).
Two blocks with equal hashes hold the same KV, so the block pool may share them (vLLM's
"Automatic Prefix Caching" design: ``hash(prefix tokens + block tokens) <-> KV block``).

Canonical serialization (msgpack, never pickle), a fixed-length array of three items::

    [parent_hash: bin, token_ids: bin (uint32 little-endian, 4 bytes a token), extra_keys: array]

``extra_keys`` is a tuple of tagged tuples (see ``hashing.extra_keys``), packed by msgpack with
tuples as arrays, ``str`` as str and ``bytes`` as bin. The bytes of this encoding are fixed by the
msgpack spec, so hashes agree across processes, machines and restarts. The first block's parent
is :func:`seed_hash` of the algorithm, a constant.

Algorithms: ``"sha256"`` (default, 32-byte digests, collision resistant: a tenant cannot craft
a prompt whose block collides with another's) and ``"xxhash"`` (xxh3-128, 16-byte digests,
faster, not collision resistant).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Literal

import msgpack
import xxhash

HashAlgorithm = Literal["sha256", "xxhash"]
"""Name of a block hash algorithm, as ``--prefix-hash`` takes it."""

BlockHash = bytes
"""A block hash: 32 bytes (SHA-256) or 16 bytes (xxh3-128)."""

ExtraKeys = tuple[tuple, ...]
"""Tagged tuples such as ``("lora", digest)``; see ``hashing.extra_keys``."""

_SEED_MESSAGE = b"loraplex/block-hash/v1"
_TOKEN_ID_LIMIT = 1 << 32


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": _sha256,
    "xxhash": xxhash.xxh3_128_digest,
}


def digest_function(algorithm: HashAlgorithm) -> Callable[[bytes], bytes]:
    """Return the raw digest function of ``algorithm``: ``bytes -> bytes``.

    Raises:
        ValueError: ``algorithm`` is not ``"sha256"`` or ``"xxhash"``.
    """
    try:
        return _DIGESTS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown prefix hash algorithm {algorithm!r}; expected 'sha256' or 'xxhash'"
        ) from None


@cache
def seed_hash(algorithm: HashAlgorithm = "sha256") -> BlockHash:
    """The fixed parent hash of a request's first block (the same in every process).

    Returns:
        ``digest(b"loraplex/block-hash/v1")``: 32 bytes for SHA-256, 16 for xxh3-128.
    """
    return digest_function(algorithm)(_SEED_MESSAGE)


def pack_token_ids(token_ids: Iterable[int]) -> bytes:
    """Pack token ids as little-endian uint32, the token field of the canonical encoding.

    Args:
        token_ids: Ints in ``[0, 2**32)``.

    Returns:
        ``4 * len(token_ids)`` bytes.

    Raises:
        ValueError: a token id is negative, too large or not an int.
    """
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - no CPython platform we support
        packed = array("L", packed)
    if sys.byteorder == "big":  # pragma: no cover - little-endian on every supported platform
        packed.byteswap()
    return packed.tobytes()


def encode_extra_keys(extra_keys: Sequence[tuple]) -> bytes:
    """Canonical msgpack encoding of a tuple of extra keys (an array of arrays).

    Raises:
        ValueError: an extra key holds a value msgpack cannot encode canonically.
    """
    try:
        return msgpack.packb(tuple(extra_keys), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"extra keys must hold only str, bytes, int or bool: {exc}") from None


def encode_block(parent_hash: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys = ()) -> bytes:
    """The canonical byte string that :func:`hash_block` digests (msgpack, see module doc).

    Raises:
        ValueError: a token id is out of range or an extra key is not encodable.
    """
    try:
        return msgpack.packb(
            (bytes(parent_hash), pack_token_ids(token_ids), tuple(extra_keys)), use_bin_type=True
        )
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"extra keys must hold only str, bytes, int or bool: {exc}") from None


def hash_block(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = (),
    algorithm: HashAlgorithm = "sha256",
) -> BlockHash:
    """Hash one full block.

    Args:
        parent_hash: The previous block's hash, or None for a request's first block (then the
            algorithm's :func:`seed_hash` is used).
        token_ids: The block's token ids, ``block_size`` ints in ``[0, 2**32)``.
        extra_keys: Tagged tuples that change what the block holds (adapter, images, salt).
        algorithm: ``"sha256"`` or ``"xxhash"``.

    Returns:
        The digest of :func:`encode_block`: 32 bytes (SHA-256) or 16 bytes (xxh3-128).

    Raises:
        ValueError: unknown algorithm, a token id out of range, an unencodable extra key.
    """
    digest = digest_function(algorithm)
    parent = seed_hash(algorithm) if parent_hash is None else parent_hash
    return digest(encode_block(parent, token_ids, extra_keys))
