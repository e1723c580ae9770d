"""Incremental detokenization for streaming, and the finish rules of one completion.

Text: tokens are turned into text with the prefix / read-offset algorithm (vLLM's
``detokenize_incrementally``): decode a short window of recent tokens, and emit the part past the
previous window's text only once the window's text is final, i.e. does not end in U+FFFD (a
UTF-8 character split across byte-level tokens: emoji, CJK, accents, comes out whole). Decoding
a window that starts a few tokens back also makes a SentencePiece word marker a space exactly
where ``decode`` makes one. Implementations:

- ``tokenizers.decoders.DecodeStream`` (the same algorithm in Rust) for fast tokenizers;
- :class:`_OffsetStream` in Python for anything else with ``decode(ids, skip_special_tokens=)``,
  and for fast tokenizers whose decoder has ``ByteFallback`` (Llama 2, Mistral, LLaVA-1.5): that
  decoder turns a whole run of ``<0xNN>`` tokens into U+FFFDs when the run is not valid UTF-8,
  so a valid-looking prefix of a run can still change; the window is held until it ends in a
  non-byte token, where no later token can change it.

When the completion finishes, one full ``decode`` releases whatever the stream still held
(bytes that never formed a valid character), so::

    "".join(every delta) == tokenizer.decode(decoded ids, skip_special_tokens=...)

where the decoded ids are the output's token ids less a final EOS / stop token (whose text is
left out unless ``include_stop_str_in_output``), before stop-string truncation. Tokenizers whose
``decode`` post-processes the whole text (``clean_up_tokenization_spaces=True``) are matched
only up to that clean-up. Stop strings are found here (they need the text); every other finish
rule is the engine core's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from loraplex.engine.client.stop import StopChecker
from loraplex.engine.sampling.params import SamplingParams


class _OffsetStream:
    """vLLM's prefix / read-offset incremental decode over any ``decode(ids)`` function.

    ``ids[prefix:read]`` is the context window whose text was already emitted; a step decodes
    ``ids[prefix:]`` and emits what lies past the context's text, if it is final::

        ids:   ... | p0 p1 p2 | r0 r1 (new)
                   ^prefix    ^read
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        ids: list[int],
        prefix_offset: int = 0,
        read_offset: int = 0,
        unstable_end: Callable[[int], bool] | None = None,
    ) -> None:
        self._decode = decode
        self._ids = ids  # shared with the owner, which appends before calling step()
        self._prefix = prefix_offset
        self._read = read_offset
        self._unstable_end = unstable_end

    def step(self) -> str | None:
        if self._unstable_end is not None and self._unstable_end(self._ids[-1]):
            return None
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return None


def _has_byte_fallback(backend: Tokenizer) -> bool:
    decoder = backend.decoder
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()


class TextStream:
    """Token ids in, text deltas out, for one sequence.

    Args:
        tokenizer: A transformers tokenizer, or a ``tokenizers.Tokenizer``.
        skip_special_tokens: Leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and isinstance(tokenizer, Tokenizer):
            backend = tokenizer
        self._backend: Tokenizer | None = backend
        self._skip = skip_special_tokens
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._clean = 0  # len(ids) at the last delta: the text up to there is final
        self._ds: DecodeStream | None = None
        self._offsets: _OffsetStream | None = None
        self._skipped: frozenset[int] = frozenset()
        if backend is None:  # the byte-fallback rule costs nothing where there is no such token
            unstable = self._open_run if hasattr(tokenizer, "convert_ids_to_tokens") else None
            if skip_special_tokens:
                self._skipped = frozenset(getattr(tokenizer, "all_special_ids", ()))
            self._offsets = _OffsetStream(self._decode, self.ids, unstable_end=unstable)
        elif _has_byte_fallback(backend):
            if skip_special_tokens:
                added = backend.get_added_tokens_decoder().items()
                self._skipped = frozenset(i for i, t in added if t.special)
            self._offsets = _OffsetStream(self._decode, self.ids, unstable_end=self._open_run)
        else:
            self._ds = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _open_run(self, token_id: int) -> bool:
        """True when a run of byte-fallback tokens may go on after ``token_id``.

        That is after a ``<0xNN>`` token, or after a special token that ``decode`` skips (the
        decoder never sees it, so the bytes on either side of it form one run).
        """
        if token_id in self._skipped:
            return True
        if self._backend is not None:
            piece = self._backend.id_to_token(token_id)
        else:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        return isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x")

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        chunk: str | None = None
        if self._ds is not None:
            try:
                chunk = self._ds.step(self._backend, token_id)
            except Exception:  # DecodeStream's "invalid prefix": continue in Python
                self._ds = None
                self._offsets = _OffsetStream(
                    self._decode, self.ids, max(0, self._clean - 6), self._clean
                )
        if self._offsets is not None:
            chunk = self._offsets.step()
        if not chunk:
            return ""
        self._clean = len(self.ids)
        self.text += chunk
        return chunk

    def flush(self) -> str:
        """The text the stream still holds back (call once, when the sequence finishes)."""
        full = self._decode(self.ids)
        if not full.startswith(self.text):  # cannot happen with prefix-stable decoders
            return ""
        rest = full[len(self.text) :]
        self.text = full
        return rest


class IncrementalDetokenizer:
    """Detokenizes one completion as it is generated and finds its stop strings.

    Only stop *strings* are found here: they need the text; none is looked for before
    ``min_tokens`` tokens (a match must end in the text of a later token). EOS, stop token
    ids, ``max_tokens``
    and the model length are the engine core's finish rules (``Scheduler.update_from_output``);
    the caller passes ``stop_token=True`` with a token that finished the sequence as EOS or a
    stop token id, then calls :meth:`finish`. A stop string found here goes back to the core
    through ``EngineCore.finish_request`` (the output processor does that).

    Args:
        tokenizer: A transformers tokenizer (fast, ideally) or a ``tokenizers.Tokenizer``.
        params: The completion's sampling params (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``).

    Attributes:
        token_ids: Every token appended, a final EOS / stop token included.
        stop_matched: The stop string that ended the text, None otherwise.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._include_stop = params.include_stop_str_in_output
        self._stream = TextStream(tokenizer, params.skip_special_tokens)
        self._stop = StopChecker(params.stop, params.include_stop_str_in_output)
        self._min_tokens = params.min_tokens  # no stop string is looked for before this many
        self.token_ids: list[int] = []
        self._finished = False
        self._text = ""

    @property
    def finished(self) -> bool:
        """True after a stop string matched or :meth:`finish`; no more :meth:`append`."""
        return self._finished

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop.matched

    @property
    def text(self) -> str:
        """Every delta returned so far, joined; the complete output text once finished.

        Safe to stream: it only ever grows (a possible stop string's start is held back).
        """
        return self._text

    def append(self, token_id: int, *, stop_token: bool = False) -> str:
        """Add the next sampled token.

        Args:
            token_id: The token the sampler picked for this sequence.
            stop_token: The core finished the sequence on this token (EOS or a stop token
                id): its text is left out unless ``include_stop_str_in_output``.

        Returns:
            The text to stream now (possibly ""). When a stop string matched
            (:attr:`stop_matched`), the returned text ends the output.

        Raises:
            RuntimeError: The completion has already finished.
        """
        if self._finished:
            raise RuntimeError("append() after the completion finished")
        self.token_ids.append(token_id)
        delta = ""
        if not stop_token or self._include_stop:
            armed = len(self.token_ids) >= self._min_tokens
            delta = self._stop.append(self._stream.step(token_id), search=armed)
        if self._stop.matched is not None:
            self._finished = True
        self._text += delta
        return delta

    def finish(self) -> str:
        """End the completion; return the text still held back ("" when already finished).

        The released tail may hold a stop string (:attr:`stop_matched` is then set): bytes
        that only decode once the stream is flushed.
        """
        if self._finished:
            return ""
        self._finished = True
        delta = self._stop.append(self._stream.flush())
        delta += self._stop.flush()
        self._text += delta
        return delta
