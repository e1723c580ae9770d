"""Incremental block hashing of one request as its tokens arrive (prompt, then generated tokens).

Only full blocks are hashed. The hasher keeps the packed tokens of the request and its hash
chain, so each call to :meth:`RequestBlockHasher.extend` hashes just the blocks that the new
tokens completed::

    tokens:  [ b0 (16) ][ b1 (16) ][ b2 (16) ][ 5 pending ]
    hashes:  [ h0       ][ h1      ][ h2      ]              h_i = H(h_{i-1}, b_i, extra_i)
                                                            h_{-1} = seed_hash(algorithm)
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from functools import lru_cache

from loraplex.hashing.block_encoder import BlockEncoder, shared_encoder
from loraplex.hashing.block_hash import (
    BlockHash,
    HashAlgorithm,
    encode_extra_keys,
    pack_token_ids,
)
from loraplex.hashing.extra_keys import (
    LORA,
    MM,
    SALT,
    MMPlaceholder,
    block_extra_keys,
    validate_placeholders,
)


class RequestBlockHasher:
    """The block hashes of one request, extended as its token ids grow.

    Args:
        block_size: Tokens per KV block (> 0).
        algorithm: ``"sha256"`` (default) or ``"xxhash"``.
        lora_digest: Digest of the request's LoRA adapter, None for the base model.
        cache_salt: The request's cache salt (the gateway sets the tenant), None for none.
        placeholders: Image placeholder runs in the prompt (any order; must not overlap).

    Attributes:
        block_hashes: One hash per full block, in logical order. Append-only.

    Raises:
        ValueError: a bad block size or algorithm, overlapping placeholders.
    """

    __slots__ = (
        "block_size",
        "block_hashes",
        "_encoder",
        "_tokens",
        "_lora_digest",
        "_cache_salt",
        "_placeholders",
        "_special_blocks",
        "_special_sorted",
        "_plain_template",
    )

    def __init__(
        self,
        block_size: int,
        *,
        algorithm: HashAlgorithm = "sha256",
        lora_digest: str | None = None,
        cache_salt: str | None = None,
        placeholders: Sequence[MMPlaceholder] = (),
    ) -> None:
        self._encoder = shared_encoder(block_size, algorithm)
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []
        self._tokens = bytearray()
        self._lora_digest = lora_digest
        self._cache_salt = cache_salt
        self._placeholders = validate_placeholders(placeholders)
        # Blocks touched by an image, and the first block when salted, get their own extra
        # keys; every other block shares one encoding (just the adapter, or nothing).
        special = {
            b
            for p in self._placeholders
            for b in range(p.offset // block_size, (p.end - 1) // block_size + 1)
        }
        if cache_salt is not None:
            special.add(0)
        self._special_blocks = frozenset(special)
        self._special_sorted = tuple(sorted(special))
        self._plain_template = _plain_template(self._encoder, lora_digest)

    @property
    def num_tokens(self) -> int:
        """Tokens seen so far, full blocks and the pending tail."""
        return len(self._tokens) // 4

    @property
    def placeholders(self) -> tuple[MMPlaceholder, ...]:
        """The request's image placeholders, sorted by offset."""
        return self._placeholders

    def stat_sources(self) -> tuple[tuple, ...]:
        """The labels hit-rate statistics are split by for this request.

        Returns:
            ``("lora", digest)`` when an adapter is set, ``("salt", salt)`` when a salt is set,
            ``("mm", True)`` when the prompt carries images.
        """
        sources: list[tuple] = []
        if self._lora_digest is not None:
            sources.append((LORA, self._lora_digest))
        if self._cache_salt is not None:
            sources.append((SALT, self._cache_salt))
        if self._placeholders:
            sources.append((MM, True))
        return tuple(sources)

    def extra_keys(self, block_index: int) -> tuple[tuple, ...]:
        """The extra keys of logical block ``block_index`` (see ``hashing.extra_keys``)."""
        return block_extra_keys(
            block_index,
            self.block_size,
            lora_digest=self._lora_digest,
            cache_salt=self._cache_salt,
            placeholders=self._placeholders,
        )

    def fork(self) -> RequestBlockHasher:
        """A copy that continues independently (the hasher of a forked sequence, n > 1)."""
        child = object.__new__(RequestBlockHasher)
        for name in self.__slots__:
            setattr(child, name, getattr(self, name))
        child.block_hashes = list(self.block_hashes)
        child._tokens = bytearray(self._tokens)
        return child

    def extend(self, token_ids: Iterable[int]) -> list[BlockHash]:
        """Append token ids and hash every block they complete.

        Args:
            token_ids: New token ids, ints in ``[0, 2**32)``.

        Returns:
            The hashes of the newly completed blocks (possibly empty), also appended to
            :attr:`block_hashes`.

        Raises:
            ValueError: a token id is out of range (nothing is appended then).
        """
        packed = pack_token_ids(token_ids)
        start_offset = len(self._tokens)
        self._tokens += packed
        nbytes = self._encoder.block_bytes
        first_new = len(self.block_hashes)
        num_full = len(self._tokens) // nbytes
        if num_full == first_new:
            return []
        hashes = self.block_hashes
        parent = hashes[-1] if hashes else self._encoder.seed
        # One copy of the newly completed bytes; bytes slices are cheaper than bytearray ones.
        if start_offset == first_new * nbytes:  # the new tokens start on a block boundary
            new_bytes = packed
        else:
            new_bytes = bytes(self._tokens[first_new * nbytes : num_full * nbytes])
        digest = self._encoder.digest
        sha256 = hashlib.sha256 if self._encoder.algorithm == "sha256" else None
        special = self._special_blocks
        i = first_new
        while i < num_full:
            # Blocks [i, stop) share one template: either one special block (the salted first
            # block, a block with images) or a run of plain blocks up to the next special one.
            if i in special:
                template = self._encoder.template(encode_extra_keys(self.extra_keys(i)))
                stop = i + 1
            else:
                template = self._plain_template
                nxt = bisect_right(self._special_sorted, i)
                stop = num_full
                if nxt < len(self._special_sorted):
                    stop = min(stop, self._special_sorted[nxt])
            span = range((i - first_new) * nbytes, (stop - first_new) * nbytes, nbytes)
            if sha256 is not None:  # hashlib's constructor direct: no wrapper call per block
                for lo in span:
                    parent = sha256(template % (parent, new_bytes[lo : lo + nbytes])).digest()
                    hashes.append(parent)
            else:
                for lo in span:
                    parent = digest(template % (parent, new_bytes[lo : lo + nbytes]))
                    hashes.append(parent)
            i = stop
        return hashes[first_new:]


@lru_cache(maxsize=1024)
def _plain_template(encoder: BlockEncoder, lora_digest: str | None) -> bytes:
    """The block template of a request's plain blocks (no image, not the salted first block)."""
    plain = ((LORA, lora_digest),) if lora_digest is not None else ()
    return encoder.template(encode_extra_keys(plain))
