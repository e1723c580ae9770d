"""Extra keys: what besides the token ids changes the KV a block holds.

Each extra key is a tagged tuple, so keys from different sources can never collide:

- ``("lora", adapter_digest)`` on every block of a request served with a LoRA adapter (the
  digest of the adapter's weights, not its name: a re-upload under the same name gets new blocks).
- ``("mm", image_key, offset)`` for every image whose placeholder tokens overlap the block;
  ``offset`` is the image's first placeholder position minus the block's first position (negative
  when the image started in an earlier block), so the same image at another position gives
  another key.
- ``("salt", cache_salt)`` on the first block only; it reaches every later block through the
  parent-hash chain.

Within one block the keys are ordered: lora, then images by position, then salt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LORA = "lora"
MM = "mm"
SALT = "salt"


@dataclass(frozen=True, slots=True)
class MMPlaceholder:
    """The run of placeholder tokens one image occupies in a prompt.

    Attributes:
        image_key: The image's key (``hashing.image_keys.image_key``), e.g. ``"phash...:ab12"``.
        offset: Position of the first placeholder token in the prompt (0-based).
        length: Number of placeholder tokens (> 0).
    """

    image_key: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"image placeholder needs offset >= 0 and length > 0, got offset={self.offset}, "
                f"length={self.length}"
            )

    @property
    def end(self) -> int:
        """One past the last placeholder position."""
        return self.offset + self.length


def validate_placeholders(placeholders: Sequence[MMPlaceholder]) -> tuple[MMPlaceholder, ...]:
    """Sort image placeholders by position and check that none overlap.

    Raises:
        ValueError: two placeholder runs overlap.
    """
    ordered = tuple(sorted(placeholders, key=lambda p: p.offset))
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.offset < before.end:
            raise ValueError(
                f"image placeholders overlap: [{before.offset}, {before.end}) and "
                f"[{after.offset}, {after.end})"
            )
    return ordered


def block_extra_keys(
    block_index: int,
    block_size: int,
    *,
    lora_digest: str | None = None,
    cache_salt: str | None = None,
    placeholders: Sequence[MMPlaceholder] = (),
) -> tuple[tuple, ...]:
    """The extra keys of block ``block_index`` of a request.

    Args:
        block_index: Logical block index (block ``i`` covers positions
            ``[i * block_size, (i + 1) * block_size)``).
        block_size: Tokens per block.
        lora_digest: The request's adapter digest, None for the base model.
        cache_salt: The request's cache salt (the tenant), None for none.
        placeholders: The request's image placeholders, sorted by offset.

    Returns:
        The tagged tuples, ordered lora, images by position, salt; ``()`` when none apply.
    """
    start = block_index * block_size
    end = start + block_size
    keys: list[tuple] = []
    if lora_digest is not None:
        keys.append((LORA, lora_digest))
    for p in placeholders:
        if p.offset >= end:
            break
        if p.end > start:
            keys.append((MM, p.image_key, p.offset - start))
    if block_index == 0 and cache_salt is not None:
        keys.append((SALT, cache_salt))
    return tuple(keys)
