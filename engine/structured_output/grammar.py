"""Structured output: decoding constrained by a JSON schema, a regex or a grammar.

A request that asks for structured output carries a :class:`StructuredOutputSpec` in its sampling
parameters. The engine core keeps one grammar matcher per sequence (llguidance's ``LLMatcher``:
an Earley parser over the tokenizer's token trie, the library vLLM and SGLang offer beside
xgrammar), and each step:

1. the scheduler asks each constrained sequence that samples for its token bitmask (one bit per
   vocabulary id, little-endian within 32-bit words) and sends it in ``ScheduledSeq``;
2. the runner sets the logits of disallowed ids to ``-inf`` on those rows only
   (:func:`apply_token_bitmasks`), in the same batch as unconstrained rows;
3. ``Scheduler.update_from_output`` advances the sequence's matcher with the sampled token; a
   sequence whose grammar is complete finishes with ``"stop"``.

A spec is checked for its shape first (``engine.structured_output.bounds``, when it is made),
vetted in a sandboxed worker process (``engine.structured_output.sandbox``), then compiled once per
process into a template matcher off the engine's step (``engine.structured_output.manager``;
bounded LRU cache keyed by the spec); each sequence gets a deep copy of it (an ``n > 1`` fork
copies its parent's). Compilation and every mask computation run under :func:`parser_limits`, so a
hostile schema is refused or cut off by fuel, never by wall time.

llguidance is used rather than xgrammar because xgrammar requires triton on Linux (~290 MB that a
CPU install does not otherwise need); llguidance has no dependencies.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplex.engine.structured_output.bounds import check_spec_bounds

if TYPE_CHECKING:
    import torch

KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
MAX_CACHED_GRAMMARS = 256  # template matchers kept per process (LRU)
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no unbounded runs of whitespace


class StructuredOutputError(ValueError):
    """A structured-output spec the engine cannot enforce (a 400 naming the request's field)."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match.

    Attributes:
        kind: ``"json_object"`` (any JSON object), ``"json_schema"`` (JSON valid against the
            schema in ``value``), ``"regex"`` (the whole output matches the regex in ``value``)
            or ``"grammar"`` (a Lark grammar in ``value``, llguidance's dialect).
        value: The schema (canonical JSON text), regex or grammar; empty for ``json_object``.

    Raises:
        ValueError: an unknown kind, a missing or too long value. (The shape is checked by
            :meth:`check_bounds`, which is not run when a spec is made: it costs milliseconds,
            and the engine core decodes every request's spec on its own thread.)
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError("structured output value must be a string")
        if self.kind != "json_object" and not self.value:
            raise ValueError(f"structured output {self.kind} needs a value")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(
                f"the {self.kind} is {len(self.value)} characters; at most {MAX_SPEC_CHARS}"
            )

    def check_bounds(self) -> StructuredOutputSpec:
        """Check the spec's shape (``structured_output.bounds``); the spec itself if it passes.

        The gateway runs it on every spec a request carries, and the grammar sandbox's worker
        on every spec it compiles (offline callers included), never the engine core.

        Raises:
            BoundError: a shape past ``engine.structured_output.bounds.DEFAULT_BOUNDS``
                (a ValueError).
        """
        check_spec_bounds(self.kind, self.value)
        return self

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputSpec:
        """A spec for JSON valid against ``schema`` (a dict, or its JSON text).

        Raises:
            ValueError: the schema is not a JSON object.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return cls(
            "json_schema", json.dumps(schema, separators=(",", ":"))
        )  # order kept: it is the output order

    def grammar(self) -> str:
        """The llguidance grammar text of this spec (no validation)."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, overrides=_JSON_OPTIONS
            )
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.value, overrides=_JSON_OPTIONS
            )
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        return llguidance.LLMatcher.grammar_from_lark(self.value)


def parser_limits():
    """The resource limits of every grammar here (llguidance fuel, not time: deterministic).

    Tighter than llguidance's defaults on grammar size and lexer states (a schema of
    :data:`MAX_SPEC_CHARS` fits easily), the same per-step fuel; errors do not echo the
    grammar's internals (logs are shared by every tenant).
    """
    import llguidance

    return llguidance.LLParserLimits(
        max_grammar_size=100_000,
        max_lexer_states=50_000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        verbose_errors=False,
    )


class GrammarCompiler:
    """Compiles specs into matchers for one tokenizer, caching a template per spec.

    Args:
        tokenizer_json: The tokenizer's serialized form (``tokenizers`` JSON, as
            ``PreTrainedTokenizerFast.backend_tokenizer.to_str()`` gives it).
        vocab_size: The model's vocabulary size (logit rows are this wide; ids the tokenizer
            does not know are never allowed).
        eos_token_ids: The ids that end a sequence (allowed once the grammar is complete).
        max_cached: Templates kept (LRU).

    Thread-safe: the gateway's input workers validate while the engine step builds matchers.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        import llguidance

        eos = sorted(set(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos or None
        )
        self.tokenizer_json = tokenizer_json  # what the grammar sandbox's workers are built from
        self.max_cached = max_cached
        self._templates: OrderedDict[StructuredOutputSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # templates built (cache misses), for tests and stats

    def cached(self, spec: StructuredOutputSpec):
        """The template matcher of ``spec`` if it is cached (made most recent), else None."""
        with self._lock:
            hit = self._templates.get(spec)
            if hit is not None:
                self._templates.move_to_end(spec)
            return hit

    def template(self, spec: StructuredOutputSpec):
        """The compiled template matcher of ``spec`` (from the cache when there).

        Raises:
            StructuredOutputError: the spec cannot be compiled: invalid JSON schema,
                unsupported schema keywords (llguidance refuses them rather than ignoring
                them), an invalid regex or grammar, or one past :func:`parser_limits`. The
                message is llguidance's.
        """
        import llguidance

        with self._lock:
            hit = self._templates.get(spec)
            if hit is not None:
                self._templates.move_to_end(spec)
                return hit
        try:
            grammar = spec.grammar()
        except ValueError as exc:
            raise StructuredOutputError(f"invalid {spec.kind}: {exc}") from None
        limits = parser_limits()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer, limits=limits
        )
        if is_error or messages:  # a warning is a keyword llguidance would not enforce
            raise StructuredOutputError(f"unsupported {spec.kind}: {'; '.join(messages)[:500]}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise StructuredOutputError(f"unsupported {spec.kind}: {matcher.get_error()[:500]}")
        matcher.compute_bitmask()  # builds the lexer's first states, shared by every copy
        if matcher.is_error():  # e.g. {"$ref": "#"}: a rule that derives no string at all
            raise StructuredOutputError(
                f"the {spec.kind} allows no token: no output can ever match it"
            )
        with self._lock:
            self._templates[spec] = matcher
            self._templates.move_to_end(spec)
            while len(self._templates) > self.max_cached:
                self._templates.popitem(last=False)
            self.num_compiled += 1
        return matcher

    def matcher(self, spec: StructuredOutputSpec):
        """A fresh matcher for one sequence (a copy of the cached template).

        Raises:
            ValueError: as :meth:`template`.
        """
        return self.template(spec).deep_copy()


def grammar_bitmask(matcher) -> bytes:
    """The ids ``matcher`` allows next, one bit each (bit ``i % 8`` of byte ``i // 8``).

    Returns:
        The mask (as wide as the tokenizer's ``n_vocab``, rounded up to 32 bits); empty bytes
        when the matcher is in an error state (out of fuel, say), which
        :func:`apply_token_bitmasks` reports as a row that allows nothing.
    """
    if matcher.is_error():
        return b""
    mask = matcher.compute_bitmask()
    return b"" if matcher.is_error() else bytes(mask)


def speculative_bitmasks(matcher, proposals: Sequence[int]) -> list[bytes]:
    """The bitmasks of a speculating row's positions after each proposal it can verify.

    The proposals are consumed one by one and each position's mask taken, then the matcher is
    rolled back to where it was. They stop before the first proposal the grammar refuses, and
    before one that would complete it (the target's own token there ends the output, and no
    position after it may be sampled against a finished grammar).

    Args:
        matcher: The sequence's ``LLMatcher`` (left as it was).
        proposals: The proposals, in order.

    Returns:
        ``m`` masks (``m <= len(proposals)``): mask ``i`` is for the position after proposal
        ``i``, so only the first ``m`` proposals are verified. The mask before the first
        proposal is the row's own (:func:`grammar_bitmask`).
    """
    masks: list[bytes] = []
    for token in proposals[: matcher.validate_tokens(list(proposals))]:
        if not matcher.consume_token(token):
            break
        if matcher.is_stopped() or matcher.is_error():
            matcher.rollback(1)
            break
        mask = grammar_bitmask(matcher)
        if not mask:
            matcher.rollback(1)
            break
        masks.append(mask)
    if masks:
        matcher.rollback(len(masks))
    return masks


def apply_token_bitmasks(
    logits: torch.Tensor, rows: Sequence[int], bitmasks: Sequence[bytes]
) -> list[int]:
    """Set the logits of disallowed ids to ``-inf`` on the constrained rows, in place.

    One vectorised masked fill over the constrained rows (no loop over the vocabulary).

    Args:
        logits: ``[num_rows, vocab_size]`` float logits of the step's sampling rows.
        rows: Indices of the constrained rows.
        bitmasks: One mask per row of ``rows``, as :func:`grammar_bitmask` gives it (at least
            ``vocab_size`` bits; the rest is ignored).

    Returns:
        The rows whose mask allows no id of the vocabulary: left unmasked, for the caller to
        fail (their grammar is in an error state).
    """
    import numpy as np
    import torch

    if not rows:
        return []
    vocab = logits.shape[-1]
    width = -(-vocab // 8)
    packed = np.frombuffer(b"".join(m[:width].ljust(width, b"\0") for m in bitmasks), np.uint8)
    allowed = np.unpackbits(packed.reshape(len(rows), width), axis=1, bitorder="little")
    allowed = allowed[:, :vocab].astype(bool)
    ok = allowed.any(axis=1)
    empty = [rows[i] for i in np.flatnonzero(~ok)]
    keep = [i for i in range(len(rows)) if ok[i]]
    if keep:
        index = torch.as_tensor([rows[i] for i in keep], device=logits.device)
        mask = torch.from_numpy(allowed[keep]).to(logits.device)
        logits[index] = logits[index].masked_fill(~mask, float("-inf"))
    return empty


def tokenizer_json(hf_tokenizer) -> str:
    """A transformers fast tokenizer's ``tokenizers`` JSON (padding and truncation off).

    Raises:
        ValueError: a slow tokenizer (no ``backend_tokenizer``).
    """
    import copy

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast (tokenizers) tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()
