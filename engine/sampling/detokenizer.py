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
only up to that clean-up.

Finish reasons (OpenAI): ``"stop"`` for EOS (unless ``ignore_eos``), a stop token id or a stop
string; ``"length"`` when ``max_tokens`` tokens were generated (or the engine calls
:meth:`IncrementalDetokenizer.finish`, e.g. at the model's context limit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.sampling.stop import StopChecker

_USE_TOKENIZER_EOS = object()


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
    """Detokenizes one completion as it is generated and decides when it is finished.

    Args:
        tokenizer: A transformers tokenizer (fast, ideally) or a ``tokenizers.Tokenizer``.
        params: The completion's sampling params (stop strings, stop tokens, max_tokens, ...).
        eos_token_ids: EOS id(s) that end the completion unless ``params.ignore_eos``; by
            default the tokenizer's ``eos_token_id``; ``()`` for none.
        prompt_token_ids: Accepted for parity with vLLM and unused: the text is the decode of
            the output ids alone, exactly as ``tokenizer.decode`` gives it (vLLM primes its
            stream with the prompt's last tokens, which differs only for SentencePiece
            tokenizers, where it keeps the first output word's leading space).

    Attributes:
        token_ids: Every token appended, EOS / stop token included.
        finish_reason: None while running, then ``"stop"`` or ``"length"`` (or what
            :meth:`finish` was given).
        stop_reason: The matched stop string or stop token id; None otherwise (EOS included).
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: int | Iterable[int] | None | object = _USE_TOKENIZER_EOS,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        if eos_token_ids is _USE_TOKENIZER_EOS:
            eos_token_ids = getattr(tokenizer, "eos_token_id", None)
        if eos_token_ids is None:
            eos: frozenset[int] = frozenset()
        elif isinstance(eos_token_ids, int):
            eos = frozenset((eos_token_ids,))
        else:
            eos = frozenset(eos_token_ids)  # type: ignore[arg-type]
        self._eos = frozenset() if params.ignore_eos else eos
        self._stop_ids = frozenset(params.stop_token_ids)
        self._params = params
        self._stream = TextStream(tokenizer, params.skip_special_tokens)
        self._stop = StopChecker(params.stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._text = ""

    @property
    def finished(self) -> bool:
        """True once a finish reason is set; :meth:`append` may not be called again."""
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """Every delta returned so far, joined; the complete output text once finished.

        Safe to stream: it only ever grows (a possible stop string's start is held back).
        """
        return self._text

    @property
    def output_text(self) -> str:
        """Alias of :attr:`text`."""
        return self._text

    def append(self, token_id: int) -> str:
        """Add the next sampled token.

        Args:
            token_id: The token the sampler picked for this sequence.

        Returns:
            The text to stream now (possibly ""). Once the completion finishes, the returned
            text completes the output, and :attr:`finish_reason` is set.

        Raises:
            RuntimeError: The completion has already finished.
        """
        if self.finished:
            raise RuntimeError("append() after the completion finished")
        self.token_ids.append(token_id)
        delta = self._step(token_id)
        self._text += delta
        return delta

    def _step(self, token_id: int) -> str:
        if token_id in self._eos or token_id in self._stop_ids:
            out = ""
            if self._params.include_stop_str_in_output:
                out = self._stop.append(self._stream.step(token_id))
            reason = None if token_id in self._eos else token_id
            return out + self._finish("stop", reason)
        out = self._stop.append(self._stream.step(token_id))
        if self._stop.matched is not None:
            self.finish_reason, self.stop_reason = "stop", self._stop.matched
            return out
        if len(self.token_ids) >= self._params.max_tokens:
            return out + self._finish("length")
        return out

    def finish(self, reason: str = "length") -> str:
        """End the completion early (context limit, abort); return the last text to stream.

        Returns "" when it has already finished.
        """
        if self.finished:
            return ""
        delta = self._finish(reason)
        self._text += delta
        return delta

    def _finish(self, reason: str, stop_reason: str | int | None = None) -> str:
        self.finish_reason, self.stop_reason = reason, stop_reason
        out = self._stop.append(self._stream.flush())
        if self._stop.matched is not None:  # the released tail held a stop string
            self.finish_reason, self.stop_reason = "stop", self._stop.matched
        return out + self._stop.flush()
