"""The block hash's hot path: :func:`~.block_hash.encode_block`'s bytes from pre-packed tokens.

:mod:`.block_hash` defines a block's hash (its canonical msgpack encoding); this module builds
the same bytes without running msgpack per block, for :mod:`.request_hasher`. Imports go one
way: ``block_hash`` <- ``block_encoder`` <- ``request_hasher``.
"""

from __future__ import annotations

from functools import lru_cache

import msgpack

from loraplex.hashing.block_hash import BlockHash, HashAlgorithm, digest_function, seed_hash


class BlockEncoder:
    """Builds :func:`encode_block`'s bytes from pre-packed tokens without re-running msgpack.

    The request block hasher calls this once per full block on its hot path; the bytes are the
    same as ``encode_block`` gives (asserted in the tests), only the msgpack headers are
    precomputed for a fixed block size and digest length.

    Args:
        block_size: Tokens in a block.
        algorithm: The hash algorithm (fixes the parent hash length).

    Attributes:
        algorithm: The hash algorithm's name.
        digest: The raw digest function.
        block_bytes: Packed bytes of one block's tokens (``4 * block_size``).
        seed: The first block's parent hash.

    Raises:
        ValueError: ``block_size`` is not positive or ``algorithm`` is unknown.
    """

    __slots__ = ("_prefix", "_middle", "algorithm", "digest", "block_bytes", "seed")

    def __init__(self, block_size: int, algorithm: HashAlgorithm = "sha256") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.algorithm = algorithm
        self.digest = digest_function(algorithm)
        self.seed = seed_hash(algorithm)
        parent_len = len(self.seed)
        self.block_bytes = 4 * block_size
        # fixarray(3) + bin header of the parent; the bin header of the tokens.
        self._prefix = b"\x93" + _bin_header(parent_len)
        self._middle = _bin_header(self.block_bytes)

    def hash(self, parent: bytes, packed_tokens: bytes, encoded_extra: bytes) -> BlockHash:
        """Digest one block from its parent, ``pack_token_ids`` bytes and encoded extra keys."""
        return self.digest(
            b"".join((self._prefix, parent, self._middle, packed_tokens, encoded_extra))
        )

    def template(self, encoded_extra: bytes) -> bytes:
        """A ``%``-format template of the block encoding for fixed extra keys.

        ``template % (parent, packed_tokens)`` equals the bytes :meth:`hash` digests; the
        constant parts are ``%``-escaped.
        """
        return b"%b".join(
            part.replace(b"%", b"%%") for part in (self._prefix, self._middle, encoded_extra)
        )


@lru_cache(maxsize=64)
def shared_encoder(block_size: int, algorithm: HashAlgorithm) -> BlockEncoder:
    """One shared (immutable) encoder per block size and algorithm."""
    return BlockEncoder(block_size, algorithm)


def _bin_header(length: int) -> bytes:
    """The msgpack bin-family header for a payload of ``length`` bytes."""
    return msgpack.packb(b"\0" * length, use_bin_type=True)[:-length]
