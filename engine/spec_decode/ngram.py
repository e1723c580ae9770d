"""N-gram prompt lookup: propose what followed the sequence's last n tokens the last time.

Prompt lookup decoding (Saxena 2023) as vLLM's ``ngram`` method does it: no extra model. The
last ``n`` tokens of the prompt and output so far are searched for earlier in the same
sequence, longest ``n`` first (``max_n`` down to ``min_n``); the tokens that followed the most
recent earlier occurrence are the proposal. Output that quotes or edits its input (code
edits, summaries that cite, JSON that repeats keys) is where it pays.

The search runs over a per-sequence ``array('i')`` of the token ids with ``bytes.rfind`` (a C
loop, no per-token Python), appended as the sequence grows, so a step costs one search per
``n`` over the sequence's bytes and no conversion of the whole list.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = array("i").itemsize


class NgramProposer:
    """Proposes up to ``k`` tokens per sequence by n-gram lookup in its own tokens.

    Args:
        min_n: Shortest suffix matched (>= 1).
        max_n: Longest suffix matched (>= ``min_n``); longer matches are tried first.

    Raises:
        ValueError: ``min_n < 1`` or ``max_n < min_n``.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._buffers: dict[str, array] = {}

    def propose(self, seq_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens of a sequence (empty when nothing matches).

        Args:
            seq_id: The sequence (its token buffer is kept until :meth:`drop`).
            token_ids: All its tokens so far (prompt and output); a buffer longer than this
                (the sequence was rolled back) is rebuilt.
            k: Most tokens to propose (>= 0).

        Returns:
            The tokens that followed the most recent earlier occurrence of the longest
            matching suffix. Where that occurrence is closer to the end than ``k`` tokens, the
            copy runs on into its own proposal (a repeating cycle of period ``p`` is
            proposed ``k`` tokens ahead, as LZ77 copies overlap).
        """
        if k <= 0:
            return []
        buf = self._buffers.get(seq_id)
        if buf is None or len(buf) > len(token_ids):
            buf = self._buffers[seq_id] = array("i", token_ids)
        elif len(buf) < len(token_ids):
            buf.extend(token_ids[len(buf) :])
        length = len(buf)
        data = memoryview(buf).cast("B")
        haystack = bytes(data[: (length - 1) * _ITEM])  # an occurrence must have a successor
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _rfind_aligned(haystack, bytes(data[(length - n) * _ITEM :]))
            if start < 0:
                continue
            src = start + n
            out: list[int] = []
            for i in range(k):
                idx = src + i
                out.append(buf[idx] if idx < length else out[idx - length])
            return out
        return []

    def drop(self, seq_id: str) -> None:
        """Forget a sequence's buffer (finished, preempted or failed)."""
        self._buffers.pop(seq_id, None)


def _rfind_aligned(haystack: bytes, needle: bytes) -> int:
    """Token index of the last occurrence of ``needle`` in ``haystack`` on a token boundary.

    Returns:
        The index in tokens, or -1.
    """
    end = len(haystack)
    while True:
        pos = haystack.rfind(needle, 0, end)
        if pos < 0:
            return -1
        if pos % _ITEM == 0:
            return pos // _ITEM
        end = pos + len(needle) - 1  # a misaligned hit: look before it
