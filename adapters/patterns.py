r"""Client regexes (PEFT's module patterns) translated to RE2, which matches in linear time.

PEFT matches ``target_modules``, ``exclude_modules``, ``layers_pattern`` and the keys of
``rank_pattern`` / ``alpha_pattern`` with Python's ``re``, a backtracking engine: one pattern such
as ``(.*)(.*)(.*)(.*)(.*)(.*)(.*)x`` takes exponential time on a module name while holding the GIL.
Here a pattern is parsed by Python's own parser (``re._parser``: parsing only, linear in the
pattern's length; nothing is matched) and its parse tree is written out as an RE2 pattern that
accepts exactly the same module names. RE2 runs in time linear in the subject (Thompson NFA and a
lazy DFA; R. Cox, "Regular Expression Matching Can Be Simple And Fast", 2007).

The domain is module names: ASCII strings without a newline. On it the translation is exact:

- every one-character matcher (a class, ``\d``/``\w``/``\s``, a negated literal, any literal under
  IGNORECASE) becomes an explicit class of the ASCII characters sre would accept, computed with
  sre's own case folding (``_sre.unicode_tolower`` / ``ascii_tolower`` and ``re._casefix``), so
  Unicode-versus-ASCII differences of the two engines cannot change a result;
- ``^``/``\A`` become ``\A`` and ``$``/``\Z`` become ``\z`` (no newline in the domain); ``\b`` and
  ``\B`` stay (ASCII word characters on both sides); ``.`` is ``[^\n]`` (or any under DOTALL);
- alternation, groups and greedy or lazy repeats keep their structure; only the groups a caller
  asks for capture.

Refused with :class:`adapters.errors.AdapterError`: what has no linear-time equivalent
(backreferences, lookahead and lookbehind, conditional groups, atomic groups, possessive repeats),
what Python itself rejects (PEFT would fail on it), patterns over :data:`MAX_PATTERN_CHARS` or
nested deeper than :data:`MAX_NESTING`, and what RE2 will not compile (counted repetitions whose
product passes 1000, a program over its memory budget).
"""

from __future__ import annotations

import _sre
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from re import _casefix  # type: ignore[attr-defined]
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

import re2

from loraplex.adapters.errors import AdapterError

MAX_PATTERN_CHARS = 1000
"""Longest client pattern accepted; PEFT's own text spliced around it adds at most
:data:`SPLICE_CHARS`."""
SPLICE_CHARS = 64
MAX_NESTING = 100
"""Deepest nesting of groups, alternations and repeats accepted."""
RE2_MAX_MEM = 8 << 20
"""RE2's memory budget per compiled pattern (program and DFA cache), bytes."""

_ALL = (1 << 128) - 1
_NEWLINE = 1 << 10


def _span(lo: int, hi: int) -> int:
    """Bits ``lo..hi`` (inclusive) of a 128-bit ASCII mask."""
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


_UPPER = _span(65, 90)
_LOWER = _span(97, 122)
_DIGIT = _span(48, 57)
_WORD = _DIGIT | _UPPER | _LOWER | 1 << 95
_SPACE_ASCII = _span(9, 13) | 1 << 32
_SPACE_UNICODE = _SPACE_ASCII | _span(0x1C, 0x1F)  # str.isspace() is true for \x1c-\x1f
_CATEGORIES = {
    C.CATEGORY_DIGIT: (_DIGIT, _DIGIT),
    C.CATEGORY_WORD: (_WORD, _WORD),
    C.CATEGORY_SPACE: (_SPACE_UNICODE, _SPACE_ASCII),
}
_NOT = {
    C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT,
    C.CATEGORY_NOT_WORD: C.CATEGORY_WORD,
    C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE,
}
FOLDS_TO_ASCII = (0x130, 0x131, 0x17F, 0x212A)
"""The non-ASCII code points that sre's Unicode case folding relates to an ASCII letter
(İ, ı, ſ, the Kelvin sign); a test rescans every code point to keep this list honest."""
_UNSUPPORTED = {
    C.GROUPREF: "a backreference (\\1, (?P=name))",
    C.GROUPREF_EXISTS: "a conditional group (?(1)...)",
    C.ASSERT: "a lookahead or lookbehind ((?=...), (?<=...))",
    C.ASSERT_NOT: "a negative lookahead or lookbehind ((?!...), (?<!...))",
    C.ATOMIC_GROUP: "an atomic group (?>...)",
    C.POSSESSIVE_REPEAT: "a possessive repeat (*+, ++, ?+, {m,n}+)",
}


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False
    options.max_mem = RE2_MAX_MEM
    return options


_RE2_OPTIONS = _options()


@dataclass(frozen=True)
class Parsed:
    """A pattern as Python's parser reads it.

    Attributes:
        source: The pattern.
        items: The top-level parse tree (``re._parser`` ``(op, argument)`` pairs).
        flags: The pattern's global flags (``re.IGNORECASE`` ..., with ``re.UNICODE`` implied).
        groups: Group name -> Python group number.
    """

    source: str
    items: list
    flags: int
    groups: dict[str, int]


def parse(source: str, where: str) -> Parsed:
    """Parse ``source`` as Python's ``re`` would, without matching anything.

    Args:
        source: The regex (a client's pattern, maybe spliced into PEFT's own).
        where: The config field, for messages.

    Raises:
        AdapterError: longer than :data:`MAX_PATTERN_CHARS` + :data:`SPLICE_CHARS`, or not a
            valid Python regex.
    """
    if len(source) > MAX_PATTERN_CHARS + SPLICE_CHARS:
        raise AdapterError(f"{where} pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:
        tree = sre_parse.parse(source)
    except re.error as exc:
        raise AdapterError(f"{where} pattern {source!r} is not a valid regex: {exc}") from None
    except (RecursionError, OverflowError, ValueError):
        raise AdapterError(f"{where} pattern {source!r} is nested too deeply") from None
    return Parsed(source, list(tree), tree.state.flags, dict(tree.state.groupdict))


def char_mask(op: Any, av: Any, flags: int) -> int:
    """The ASCII characters one one-character matcher accepts, as a 128-bit mask.

    Follows sre (``re._compiler._compile`` and ``_optimize_charset``): under IGNORECASE a class
    is folded with ``tolower`` plus sre's extra cases and tested on the subject's lower case.

    Args:
        op: ``LITERAL``, ``NOT_LITERAL``, ``ANY``, ``IN`` or ``CATEGORY``.
        av: Its argument.
        flags: The flags in force.

    Returns:
        Bit ``c`` set when the character ``chr(c)`` matches.
    """
    if op is C.ANY:
        return _ALL if flags & C.SRE_FLAG_DOTALL else _ALL & ~_NEWLINE
    if op is C.LITERAL:
        items = [(C.LITERAL, av)]
    elif op is C.NOT_LITERAL:
        items = [(C.NEGATE, None), (C.LITERAL, av)]
    elif op is C.CATEGORY:
        items = [(C.CATEGORY, av)]
    else:
        items = av
    icase = bool(flags & C.SRE_FLAG_IGNORECASE)
    unicode = not flags & C.SRE_FLAG_ASCII
    negate, folded = False, 0
    for kind, arg in items:
        if kind is C.NEGATE:
            negate = True
        elif kind is C.LITERAL:
            folded |= _fold(arg, unicode) if icase else (1 << arg if arg < 128 else 0)
        elif kind is C.RANGE:
            folded |= _fold_range(*arg, unicode) if icase else _range_mask(*arg)
        elif kind is C.CATEGORY:
            folded |= _category(arg, unicode)
        else:  # pragma: no cover - the parser puts nothing else in a class
            raise AdapterError(f"unexpected item {kind} in a character class")
    mask = (folded & ~_UPPER) | ((folded & _LOWER) >> 32) if icase else folded
    return _ALL & ~mask if negate else mask


def _range_mask(lo: int, hi: int) -> int:
    return _span(lo, min(hi, 127)) if lo < 128 else 0


def _category(code: Any, unicode: bool) -> int:
    if code in _NOT:
        return _ALL & ~_category(_NOT[code], unicode)
    uni, ascii_ = _CATEGORIES[code]
    return uni if unicode else ascii_


@functools.lru_cache(maxsize=4096)
def _fold(c: int, unicode: bool) -> int:
    """ASCII characters in sre's folded class for the literal ``c``."""
    if not unicode:
        low = _sre.ascii_tolower(c)
        return 1 << low if low < 128 else 0
    low = _sre.unicode_tolower(c)
    mask = 1 << low if low < 128 else 0
    for extra in _casefix._EXTRA_CASES.get(low, ()):
        if extra < 128:
            mask |= 1 << extra
    return mask


def _fold_range(lo: int, hi: int, unicode: bool) -> int:
    ascii_part = _range_mask(lo, hi)
    mask = (ascii_part & ~_UPPER) | ((ascii_part & _UPPER) << 32)
    if unicode:
        for c in FOLDS_TO_ASCII:
            if lo <= c <= hi:
                mask |= _fold(c, unicode)
    return mask


@functools.lru_cache(maxsize=4096)
def mask_class(mask: int) -> str:
    """An RE2 class accepting exactly the ASCII characters of ``mask`` (never matches if 0)."""
    if mask == 0:
        return r"[^\x00-\x{10FFFF}]"
    runs = []
    while mask:
        start = (mask & -mask).bit_length() - 1
        run = ~(mask >> start) & ((mask >> start) + 1)  # lowest clear bit above the run
        end = start + run.bit_length() - 2
        runs.append(rf"\x{{{start:X}}}" + (rf"-\x{{{end:X}}}" if end > start else ""))
        mask &= ~_span(start, end)
    return "[" + "".join(runs) + "]"


def is_plain_name(key: str) -> bool:
    """Whether ``key`` holds only ``A-Z a-z 0-9 _ .``, as PEFT and EVA write module names.

    In such a key every character is a literal and every ``.`` matches any character but a
    newline, so its meaning needs no parser.
    """
    return _PLAIN_NAME.fullmatch(key) is not None


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.]*")
ANY_BUT_NEWLINE = _ALL & ~_NEWLINE
"""The mask of ``.`` without DOTALL."""


def _literal(c: int) -> str:
    ch = chr(c)
    return ch if ch.isascii() and (ch.isalnum() or ch == "_") else rf"\x{{{c:X}}}"


class _Writer:
    """Writes a parse tree as RE2 syntax (see the module docstring)."""

    def __init__(self, where: str, source: str, capture: frozenset[int]) -> None:
        self.where = where
        self.source = source
        self.capture = capture
        self.order: list[int] = []

    def refuse(self, what: str) -> AdapterError:
        return AdapterError(
            f"{self.where} pattern {self.source!r} uses {what}, which has no linear-time "
            "match; adapter patterns are matched with RE2"
        )

    def seq(self, items: Iterable, flags: int, depth: int) -> str:
        if depth > MAX_NESTING:
            raise AdapterError(
                f"{self.where} pattern {self.source!r} nests more than {MAX_NESTING} levels deep"
            )
        return "".join(self.item(op, av, flags, depth) for op, av in items)

    def item(self, op: Any, av: Any, flags: int, depth: int) -> str:
        if op in _UNSUPPORTED:
            raise self.refuse(_UNSUPPORTED[op])
        if op is C.LITERAL and not flags & C.SRE_FLAG_IGNORECASE:
            return _literal(av)
        if op is C.ANY:
            return "(?s:.)" if flags & C.SRE_FLAG_DOTALL else r"[^\n]"
        if op in (C.LITERAL, C.NOT_LITERAL, C.IN, C.CATEGORY):
            return mask_class(char_mask(op, av, flags))
        if op is C.BRANCH:
            return "(?:" + "|".join(self.seq(b, flags, depth + 1) for b in av[1]) + ")"
        if op is C.SUBPATTERN:
            group, add, remove, sub = av
            inner = self.seq(sub, _combine_flags(flags, add, remove), depth + 1)
            if group is not None and group in self.capture:
                self.order.append(group)
                return "(" + inner + ")"
            return "(?:" + inner + ")"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, sub = av
            inner = "(?:" + self.seq(sub, flags, depth + 1) + ")"
            lazy = "?" if op is C.MIN_REPEAT else ""
            return inner + _quantifier(lo, hi) + lazy
        if op is C.AT:
            return _AT[av]
        raise self.refuse(f"the construct {op}")  # pragma: no cover - none left in 3.11


_AT = {
    C.AT_BEGINNING: r"\A",
    C.AT_BEGINNING_STRING: r"\A",
    C.AT_END: r"\z",
    C.AT_END_STRING: r"\z",
    C.AT_BOUNDARY: r"\b",
    C.AT_NON_BOUNDARY: r"\B",
}


def _quantifier(lo: int, hi: int) -> str:
    if hi is C.MAXREPEAT or hi == C.MAXREPEAT:
        return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    if (lo, hi) == (0, 1):
        return "?"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _combine_flags(flags: int, add: int, remove: int) -> int:
    """Flags inside ``(?a-b:...)``, as ``re._compiler._combine_flags``."""
    if add & sre_parse.TYPE_FLAGS:
        flags &= ~sre_parse.TYPE_FLAGS
    return (flags | add) & ~remove


@dataclass(frozen=True)
class Compiled:
    """A client pattern compiled by RE2.

    Attributes:
        source: The Python pattern.
        re2_source: Its RE2 translation.
        regex: The compiled RE2 regex (``match`` / ``fullmatch`` take ``bytes`` or ``str``).
        groups: Captured group name -> RE2 group number.
    """

    source: str
    re2_source: str
    regex: Any
    groups: dict[str, int]


def translate(parsed: Parsed, where: str, capture: tuple[str, ...] = ()) -> tuple[str, dict]:
    """The RE2 source equivalent to ``parsed`` on module names, and its captured groups.

    Args:
        parsed: From :func:`parse`.
        where: The config field, for messages.
        capture: Names of the groups to keep capturing (all others become ``(?:...)``).

    Returns:
        ``(re2_source, {name: re2_group_number})``.

    Raises:
        AdapterError: a construct without a linear-time equivalent, or too deep a nesting.
    """
    wanted = frozenset(parsed.groups[name] for name in capture if name in parsed.groups)
    writer = _Writer(where, parsed.source, wanted)
    body = writer.seq(parsed.items, parsed.flags, 0)
    by_number = {number: name for name, number in parsed.groups.items()}
    return body, {by_number[g]: i + 1 for i, g in enumerate(writer.order)}


def compile_pattern(source: str, where: str, capture: tuple[str, ...] = ()) -> Compiled:
    """Parse, translate and compile a Python regex for linear-time matching on module names.

    Args:
        source: The regex, exactly as Python's ``re`` would receive it.
        where: The config field, for messages.
        capture: Group names whose spans the caller reads.

    Returns:
        The compiled pattern.

    Raises:
        AdapterError: see :func:`parse` and :func:`translate`; RE2 refuses the translation
            (e.g. counted repetitions nested past 1000, a program over :data:`RE2_MAX_MEM`).
    """
    return compile_parsed(parse(source, where), where, capture)


def compile_parsed(parsed: Parsed, where: str, capture: tuple[str, ...] = ()) -> Compiled:
    """:func:`compile_pattern` for an already parsed pattern."""
    body, groups = translate(parsed, where, capture)
    try:
        regex = re2.compile(body, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise AdapterError(
            f"{where} pattern {parsed.source!r} is too large or repeats too much to match "
            f"in linear time ({reason})"
        ) from None
    return Compiled(parsed.source, body, regex, groups)


def check_subject(name: str) -> bytes:
    """A module name as RE2 input, checked to lie in the translation's domain.

    Raises:
        ValueError: a non-ASCII name or one holding a newline (never a served model's module).
    """
    if not name.isascii() or "\n" in name:
        raise ValueError(f"module name {name!r} is outside the pattern domain (ASCII, no newline)")
    return name.encode("ascii")


class PatternBudget:
    """Counts pattern evaluations against a fixed cap, so no config costs more than that.

    Args:
        limit: Most evaluations (one RE2 match or one indexed lookup each).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def spend(self, n: int = 1) -> None:
        """Count ``n`` evaluations.

        Raises:
            AdapterError: past the limit.
        """
        self.used += n
        if self.used > self.limit:
            raise AdapterError(
                f"the adapter's module patterns need more than {self.limit} regex evaluations "
                "against the served model's modules; name the modules, or use fewer regex "
                "keys in rank_pattern / alpha_pattern"
            )
