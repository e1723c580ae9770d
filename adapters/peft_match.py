r"""PEFT's target and pattern-key matching, reimplemented over RE2 (:mod:`adapters.patterns`).

Mirrors, for one ``LoraConfig``, the two PEFT functions that decide what an adapter adapts:

- ``peft.tuners.tuners_utils.check_target_module_exists``: ``exclude_modules`` first (a regex
  string is ``re.fullmatch``-ed; list entries match a name or a ``.``-suffix of it); then a regex
  string ``target_modules`` is ``re.fullmatch``-ed; a name listed exactly is targeted without any
  layer check; otherwise a list entry must be a ``.``-suffix of the name and, with
  ``layers_to_transform``, the layer index read by ``re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")``
  for each ``layers_pattern`` ``p`` (the first that matches), or by
  ``re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.")`` without one, must be among them.
- ``peft.utils.other.get_pattern_key``: the first key ``k`` of ``rank_pattern`` /
  ``alpha_pattern``, in order, for which ``re.match(rf"(.*\.)?({k})$", name)`` succeeds; else the
  name itself.

Client text is spliced into PEFT's own pattern exactly as PEFT does, then parsed and translated
as a whole, so a key such as ``a)|(b`` means here what it means in PEFT. List entries never go
through a regex. Keys that are a fixed sequence of characters (EVA writes one per module, e.g.
``model.layers.0.self_attn.q_proj`` with ``.`` meaning any character) are answered from an index
in time independent of their number; the rest are RE2 matches, all counted by a
:class:`adapters.patterns.PatternBudget`.
"""

from __future__ import annotations

from collections.abc import Iterable
from re import _constants as C  # type: ignore[attr-defined]
from typing import Any

from loraplex.adapters.patterns import (
    ANY_BUT_NEWLINE,
    Compiled,
    PatternBudget,
    char_mask,
    check_subject,
    compile_parsed,
    compile_pattern,
    is_plain_name,
    parse,
)

_SINGLE = (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN, C.CATEGORY)
_DEFAULT_LAYER_RE = r".*?\.[^.]*\.(?P<idx>\d+)\."


def _plain(tree: Any) -> Any:
    """A parse tree as nested tuples (``re._parser.SubPattern`` has no ``==``)."""
    if isinstance(tree, list | tuple) or type(tree).__name__ == "SubPattern":
        return tuple(_plain(x) for x in tree)
    return tree


_KEY_PREFIX_ITEM = _plain(parse(r"(.*\.)?(x)$", "internal").items[0])


def dot_suffixes(name: str) -> list[str]:
    r"""``name`` and every part of it after a ``.``: what ``(.*\.)?`` can leave for a key."""
    return [name] + [name[i + 1 :] for i, ch in enumerate(name) if ch == "."]


def suffix_match(name: str, entries: set[str] | frozenset[str]) -> bool:
    """PEFT's list test ``name in entries or any(name.endswith("." + e) for e in entries)``.

    Computed from the name's ``.``-suffixes, so it costs O(len(name)), not O(len(entries)).
    """
    return any(s in entries for s in dot_suffixes(name))


class PatternKeys:
    """``get_pattern_key`` over an ordered set of ``rank_pattern`` / ``alpha_pattern`` keys.

    Args:
        keys: The dict's keys, in order.
        where: ``"rank_pattern"`` or ``"alpha_pattern"``.

    Raises:
        AdapterError: a key that is not a valid regex or has no linear-time equivalent.
    """

    def __init__(self, keys: Iterable[str], where: str) -> None:
        self.keys = list(keys)
        self._general: list[tuple[int, Compiled]] = []
        # length -> [(wildcard positions, fixed positions, {fixed chars: [(index, masks)]})]
        self._fixed: dict[int, dict[tuple, tuple[tuple, dict[str, list]]]] = {}
        for index, key in enumerate(self.keys):
            if is_plain_name(key):  # a module name: no parser needed (most keys, all of EVA's)
                wild = tuple(i for i, ch in enumerate(key) if ch == ".")
                self._add(
                    index, len(key), wild, key.replace(".", ""), (ANY_BUT_NEWLINE,) * len(wild)
                )
                continue
            parsed = parse(rf"(.*\.)?({key})$", where)
            masks = _fixed_masks(parsed)
            if masks is None:
                self._general.append((index, compile_parsed(parsed, where)))
            elif all(masks):  # a position no ASCII character matches: the key never matches
                wild = tuple(i for i, m in enumerate(masks) if m & (m - 1))
                chars = "".join(chr(m.bit_length() - 1) for m in masks if not m & (m - 1))
                self._add(index, len(masks), wild, chars, tuple(masks[i] for i in wild))

    def _add(self, index: int, length: int, wild: tuple, chars: str, wild_masks: tuple) -> None:
        """Index a fixed key: ``chars`` at the positions outside ``wild``, masks at ``wild``."""
        groups = self._fixed.setdefault(length, {})
        fixed = tuple(i for i in range(length) if i not in wild) if wild not in groups else None
        _, table = groups.setdefault(wild, (fixed, {}))
        table.setdefault(chars, []).append((index, wild_masks))

    def first(self, name: str, budget: PatternBudget) -> int | None:
        """Index of the first key that matches ``name`` (PEFT's order), or None.

        Raises:
            AdapterError: the budget is spent.
        """
        subject = check_subject(name)
        best: int | None = None
        for suffix in dot_suffixes(name):
            for wild, (fixed, table) in self._fixed.get(len(suffix), {}).items():
                budget.spend()
                for index, masks in table.get("".join(suffix[i] for i in fixed), ()):
                    if best is not None and index >= best:
                        break
                    if all(m >> ord(suffix[i]) & 1 for i, m in zip(wild, masks, strict=True)):
                        best = index
                        break
        for index, compiled in self._general:
            if best is not None and index >= best:
                break
            budget.spend()
            if compiled.regex.match(subject) is not None:
                best = index
        return best

    def key_for(self, name: str, budget: PatternBudget) -> str:
        """``get_pattern_key(keys, name)``: the first matching key, else ``name``."""
        index = self.first(name, budget)
        return name if index is None else self.keys[index]


def _fixed_masks(parsed: Any) -> list[int] | None:
    r"""Per-position ASCII masks when the spliced key is ``(.*\.)?(c1 c2 ... cn)$``."""
    items = parsed.items
    if len(items) != 3 or _plain(items[0]) != _KEY_PREFIX_ITEM or items[2] != (C.AT, C.AT_END):
        return None
    if items[1][0] is not C.SUBPATTERN:
        return None
    group, add, remove, sub = items[1][1]
    if group != 2 or add or remove:
        return None
    if not all(item_op in _SINGLE for item_op, _ in sub):
        return None
    return [char_mask(item_op, av, parsed.flags) for item_op, av in sub]


class TargetMatcher:
    """``check_target_module_exists`` and ``get_pattern_key`` for one config, over RE2.

    Args:
        config: A ``LoraConfig`` (``target_modules`` a set or a regex string; ``modules_to_save``
            and ``target_parameters`` already refused).
        budget: Counts every regex evaluation.

    Raises:
        AdapterError: a pattern that is invalid or has no linear-time equivalent.
    """

    def __init__(self, config: Any, budget: PatternBudget) -> None:
        self.budget = budget
        self.targets = config.target_modules
        self.excluded = config.exclude_modules
        self._target_re = (
            compile_pattern(self.targets, "target_modules")
            if isinstance(self.targets, str)
            else None
        )
        self._exclude_re = (
            compile_pattern(self.excluded, "exclude_modules")
            if isinstance(self.excluded, str) and self.excluded
            else None
        )
        self.layer_indexes = config.layers_to_transform
        patterns = config.layers_pattern
        if patterns is None or len(patterns) == 0:
            sources = [_DEFAULT_LAYER_RE]
        else:
            patterns = [patterns] if isinstance(patterns, str) else patterns
            sources = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in patterns]
        self._layer_res = (
            [compile_pattern(s, "layers_pattern", capture=("idx",)) for s in sources]
            if self._uses_layer_indexes
            else []
        )
        self.rank_keys = PatternKeys(config.rank_pattern or {}, "rank_pattern")
        self.alpha_keys = PatternKeys(config.alpha_pattern or {}, "alpha_pattern")

    @property
    def _uses_layer_indexes(self) -> bool:
        indexes = self.layer_indexes
        return indexes is not None and (len(indexes) != 0 if isinstance(indexes, list) else True)

    def targets_module(self, name: str) -> bool:
        """Whether PEFT's ``check_target_module_exists(config, name)`` is truthy.

        Raises:
            AdapterError: the budget is spent.
        """
        subject = check_subject(name)
        if self._exclude_re is not None:
            self.budget.spend()
            if self._exclude_re.regex.fullmatch(subject) is not None:
                return False
        elif self.excluded and not isinstance(self.excluded, str):
            if suffix_match(name, self.excluded):
                return False
        if self._target_re is not None:
            self.budget.spend()
            return self._target_re.regex.fullmatch(subject) is not None
        if name in self.targets:
            return True
        if not suffix_match(name, self.targets):
            return False
        if not self._uses_layer_indexes:
            return True
        index = self._layer_index(subject)
        if index is None:
            return False
        if isinstance(self.layer_indexes, int):
            return index == self.layer_indexes
        return index in self.layer_indexes

    def _layer_index(self, subject: bytes) -> int | None:
        """The layer index PEFT reads from a module name (first ``layers_pattern`` matching)."""
        for compiled in self._layer_res:
            self.budget.spend()
            match = compiled.regex.match(subject)
            if match is not None:
                return int(match.group(compiled.groups["idx"]))
        return None
