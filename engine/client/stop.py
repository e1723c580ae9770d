"""Stop strings over a stream of text deltas, with a hold-back so nothing is ever retracted.

A stop string can arrive split across deltas (``"###"`` as ``"#"`` then ``"##"``). Text that
could still be the start of a stop string is held back from the stream: with the longest stop
string ``L`` characters long, the last ``L - 1`` characters are kept until more text shows they
are not part of a stop, or the sequence finishes (:meth:`StopChecker.flush`)::

    text so far:    ...the answer is 42#|#
                                         ^-- held back (L = 3: "###"), not streamed yet
    next delta "#": ...the answer is 42 | ### -> match; output cut at the match

When the stop string is kept in the output (``include_stop_str_in_output``) nothing needs to be
held back: the text before the end of a match is output either way.

Which match wins: the one that ends first (what a character-by-character stream would hit
first); among matches ending at the same place, the longest (so the output never keeps a piece
of a stop string).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Finds stop strings in an output's text as it grows.

    Args:
        stop: Stop strings (non-empty); may be empty for no stop strings.
        include_stop_str_in_output: Keep the matched stop string at the end of the output.

    Attributes:
        matched: The stop string that ended the output, or None.
    """

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stop)
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._include = include_stop_str_in_output
        self._hold = 0 if include_stop_str_in_output else max(self._max_len - 1, 0)
        self._text = ""
        self._sent = 0  # characters of _text already returned to the caller
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The output text so far (cut at the stop once one matched), held-back part included."""
        return self._text

    @property
    def held_back(self) -> int:
        """Characters of :attr:`text` not yet returned by :meth:`append`."""
        return len(self._text) - self._sent

    def append(self, delta: str, *, search: bool = True) -> str:
        """Add newly decoded text; return the text that is now safe to stream.

        After a match, the returned text ends the output (cut before the stop string, or after
        it when it is kept) and later calls return "".

        Args:
            delta: New text from the detokenizer (may be empty).
            search: Look for stop strings ending in this delta (False while ``min_tokens``
                is not reached: vLLM's rule).

        Returns:
            The next piece of output text, possibly empty.
        """
        if self.matched is not None:
            return ""
        old_len = len(self._text)
        self._text += delta
        if self._stops and delta and search:
            hit = self._find(max(0, old_len - self._max_len + 1))
            if hit is not None:
                start, stop = hit
                self._text = self._text[: start + len(stop) if self._include else start]
                self.matched = stop
                return self._release(len(self._text))
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        """Release the held-back text (call once the output is finished)."""
        return self._release(len(self._text))

    def _find(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, int, int, str] | None = None  # (end, -len, start, stop)
        for stop in self._stops:
            i = self._text.find(stop, start)
            if i >= 0:
                key = (i + len(stop), -len(stop), i, stop)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[2], best[3])

    def _release(self, upto: int) -> str:
        upto = max(upto, self._sent)
        out = self._text[self._sent : upto]
        self._sent = upto
        return out
