"""The CPU swap pool: where a preempted sequence's KV waits under the ``swap`` policy."""

from __future__ import annotations


class CpuBlockPool:
    """Block ids of a host-memory KV pool (the tensors live in the model runner).

    Args:
        num_blocks: Blocks in the CPU pool (>= 0).

    Raises:
        ValueError: ``num_blocks`` is negative.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Free CPU blocks."""
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return taken

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool.

        Raises:
            ValueError: a block id is out of range or already free.
        """
        free = set(self._free)
        for b in blocks:
            if not 0 <= b < self.num_blocks or b in free:
                raise ValueError(f"bad CPU block free: {b}")
            free.add(b)
        self._free.extend(reversed(blocks))
