"""Block tables: a sequence's logical -> physical block mapping, and slot mapping from it.

Logical block ``j`` of a sequence holds its tokens ``[j * block_size, (j + 1) * block_size)``;
the table maps it to a physical block id. Token position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size`` of every layer's flattened
``[num_blocks * block_size, num_kv_heads, head_dim]`` K and V caches::

    positions  0 ... 15 | 16 ... 31 | 32 ... 40
    logical    0        | 1         | 2
    physical   7        | 3         | 12          -> slot(35) = 12 * 16 + 3 = 195
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.engine.kv_cache.manager import SlotAllocation


class BlockTable:
    """One sequence's block table, grown by appending the blocks the manager allocates.

    Args:
        block_size: Token slots per block.
        block_ids: Initial physical ids (e.g. a fork's parent table).

    Raises:
        ValueError: ``block_size`` is not positive.
    """

    __slots__ = ("block_size", "block_ids")

    def __init__(self, block_size: int, block_ids: Iterable[int] = ()) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.block_ids: list[int] = list(block_ids)

    def __len__(self) -> int:
        return len(self.block_ids)

    def __getitem__(self, logical: int) -> int:
        return self.block_ids[logical]

    def append(self, block_ids: Iterable[int]) -> None:
        """Append physical ids as the next logical blocks."""
        self.block_ids.extend(block_ids)

    def apply(self, allocation: SlotAllocation) -> None:
        """Apply an allocation: copy-on-write replacements, then the appended blocks."""
        for copy in allocation.copies:
            if self.block_ids[copy.logical_index] != copy.src:
                raise ValueError(
                    f"copy-on-write of logical block {copy.logical_index}: table holds "
                    f"{self.block_ids[copy.logical_index]}, allocation says {copy.src}"
                )
            self.block_ids[copy.logical_index] = copy.dst
        self.block_ids.extend(allocation.new_block_ids)

    def capacity(self) -> int:
        """Token slots the table covers: ``len(self) * block_size``."""
        return len(self.block_ids) * self.block_size

    def slot(self, position: int) -> int:
        """The flat KV slot of token ``position``.

        Raises:
            IndexError: the position is negative or beyond the table.
        """
        if position < 0:
            raise IndexError(f"position {position} is negative")
        return self.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Flat KV slots of positions ``[start, end)``, where a step writes its new tokens.

        Raises:
            IndexError: the range is not within ``[0, capacity())``.
        """
        if not 0 <= start <= end <= self.capacity():
            raise IndexError(f"positions [{start}, {end}) outside [0, {self.capacity()})")
        bs = self.block_size
        ids = self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]
