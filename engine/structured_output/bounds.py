"""Structural bounds on a structured-output spec, checked before any grammar is compiled.

A JSON schema or a regex is compiled by native code (llguidance, Rust) whose cost and stack use
grow with the schema's shape, not only its length: a chain of 1,050 ``$defs`` that each
``$ref`` the next (65 KB of text, inside the 64 KiB limit) overflows the compiler's stack and
kills the process (SIGSEGV); ``a{1000000}`` compiles into a million-state lexer; an object with
more than about 450 optional properties compiles, then fails at its second token (llguidance's
Earley rows hold at most 2,000 items, about 4.4 per optional property). These checks are plain
Python over the parsed schema, linear in its size, and refuse such shapes with a message that
names the bound, before anything native runs. The grammar sandbox
(``engine.structured_output.sandbox``) is the second line, for what no structural bound foresees.

The figures are OpenAI's documented Structured Outputs limits where OpenAI has one (1,000
``enum`` values in a schema; its 5,000 properties and 10 levels are not reachable in 64 KiB and
too tight, respectively, for what tools send here), else the measured limits above with a
margin. ``docs/structured_output.md`` lists them with the 400 each gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class GrammarBounds:
    """How large a structured-output spec may be in shape (its text is capped separately).

    Attributes:
        max_depth: Longest chain of nested subschemas from the root, counting each ``$ref``
            followed as one more level (a ``$ref`` back to a schema already on the chain, that
            is recursion such as a tree's children, ends the chain).
        max_object_properties: Most ``properties`` of one object schema.
        max_total_properties: Most ``properties`` in the whole schema.
        max_enum_values: Most ``enum`` values in the whole schema (OpenAI's limit).
        max_regex_repeat: Largest product of nested counted repetitions (``{m,n}``) in one
            regex: ``a{100}`` is 100, ``(a{100}){100}`` is 10,000. Applies to ``guided_regex``
            and to every ``pattern`` / ``patternProperties`` regex of a schema.
    """

    max_depth: int = 64
    max_object_properties: int = 400
    max_total_properties: int = 2_048
    max_enum_values: int = 1_000
    max_regex_repeat: int = 10_000


DEFAULT_BOUNDS = GrammarBounds()


def _subschemas(node: dict[str, Any]) -> list[Any]:
    """The subschemas directly inside ``node`` (keyword by keyword; refs not followed)."""
    out: list[Any] = []
    for name in _ONE:
        if isinstance(node.get(name), dict):
            out.append(node[name])
    for name in _LIST:
        if isinstance(node.get(name), list):
            out.extend(node[name])
    for name in _MAP:
        if isinstance(node.get(name), dict):
            out.extend(node[name].values())
    return out


class BoundError(ValueError):
    """A spec past one of :class:`GrammarBounds` (a 400 naming the request's field)."""


def check_spec_bounds(kind: str, value: str, bounds: GrammarBounds = DEFAULT_BOUNDS) -> None:
    """Check a spec's shape (``StructuredOutputSpec``'s ``kind`` and ``value``).

    ``json_schema`` values are parsed and walked; ``regex`` values are scanned; ``json_object``
    has nothing to check, and ``grammar`` (Lark, offered to offline callers only) is left to
    the sandbox.

    Raises:
        BoundError: the first bound the spec passes, named with its limit.
    """
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise BoundError("the JSON schema is not valid JSON (or nested too deeply)") from None
        check_schema_bounds(schema, bounds)
    elif kind == "regex":
        check_regex_bounds(value, bounds)


def check_schema_bounds(schema: Any, bounds: GrammarBounds = DEFAULT_BOUNDS) -> None:
    """Check a parsed JSON schema against ``bounds`` (depth, properties, enums, regexes).

    Linear in the schema's size: each subschema is measured once (memoized by identity), and
    the walk stops as soon as the depth passes ``max_depth``, so its own recursion is bounded.

    Raises:
        BoundError: the first bound the schema passes.
    """
    _SchemaWalk(schema, bounds).run()


class _SchemaWalk:
    def __init__(self, root: Any, bounds: GrammarBounds) -> None:
        self.root = root
        self.bounds = bounds
        self.depth: dict[int, int] = {}  # id(subschema) -> longest chain below it, done
        self.on_chain: set[int] = set()
        self.counted: set[int] = set()  # subschemas whose properties/enums were counted
        self.properties = 0
        self.enum_values = 0
        self.base: dict[int, str] = {}  # id(subschema) -> its base URI
        self.named: dict[str, Any] = {}  # absolute URI ($id, $id#anchor) -> subschema

    def run(self) -> None:
        self._index()
        self._measure(self.root, 1)

    def _index(self) -> None:
        """Record every subschema's base URI and every ``$id`` / ``$anchor`` (iteratively)."""
        stack: list[tuple[Any, str]] = [(self.root, "")]
        seen: set[int] = set()
        while stack:
            node, base = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            for key in ("$id", "id"):
                if isinstance(node.get(key), str):
                    base = urljoin(base, node[key])
                    self.named[base.split("#")[0]] = node
                    break
            self.base[id(node)] = base
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    self.named[base.split("#")[0] + "#" + node[key]] = node
            stack.extend((child, base) for child in _subschemas(node))

    def _measure(self, node: Any, level: int) -> int:
        """Longest chain of subschemas from ``node`` (1 for a leaf); ``level``: its own."""
        if not isinstance(node, dict):
            return 0  # a boolean schema, or garbage the compiler will refuse by itself
        key = id(node)
        if key in self.on_chain:
            return 0  # recursion: the compiler makes it a rule, it does not unfold it
        done = self.depth.get(key)
        if done is not None:
            if level - 1 + done > self.bounds.max_depth:
                self._too_deep()
            return done
        if level > self.bounds.max_depth:
            self._too_deep()
        self._count(node)
        self.on_chain.add(key)
        below = 0
        children = _subschemas(node)
        for name in ("$ref", "$dynamicRef", "$recursiveRef"):
            if isinstance(node.get(name), str):
                children.append(self._resolve(node[name], self.base.get(key, "")))
        for child in children:
            below = max(below, self._measure(child, level + 1))
        self.on_chain.discard(key)
        self.depth[key] = below + 1
        return below + 1

    def _too_deep(self) -> None:
        raise BoundError(
            f"the JSON schema nests more than {self.bounds.max_depth} levels of subschemas "
            "(counting each $ref followed)"
        )

    def _resolve(self, ref: str, base: str) -> Any:
        """The subschema ``ref`` names, resolved against ``base`` as JSON Schema does.

        Raises:
            BoundError: ``ref`` names nothing in this schema (a remote document, an unknown
                anchor): the bounds could not follow it, so it is refused rather than trusted.
        """
        target = urljoin(base, ref) if base else ref
        document, _, fragment = target.partition("#")
        node = self.named.get(document, self.root if document in ("", base.split("#")[0]) else None)
        if node is not None and fragment and not fragment.startswith("/"):
            node = self.named.get(f"{document}#{unquote(fragment)}")
        elif node is not None and fragment:
            for part in fragment[1:].split("/"):
                part = unquote(part).replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    node = None
                    break
        if node is None:
            raise BoundError(
                f"the JSON schema's $ref {ref[:100]!r} names nothing within the schema (only "
                "references inside it can be followed)"
            )
        return node

    def _count(self, node: dict[str, Any]) -> None:
        if id(node) in self.counted:
            return
        self.counted.add(id(node))
        b = self.bounds
        props = node.get("properties")
        if isinstance(props, dict):
            if len(props) > b.max_object_properties:
                raise BoundError(
                    f"an object schema has {len(props)} properties; at most "
                    f"{b.max_object_properties}"
                )
            self.properties += len(props)
            if self.properties > b.max_total_properties:
                raise BoundError(
                    f"the JSON schema has more than {b.max_total_properties} properties in all"
                )
        enum = node.get("enum")
        if isinstance(enum, list):
            self.enum_values += len(enum)
            if self.enum_values > b.max_enum_values:
                raise BoundError(
                    f"the JSON schema has more than {b.max_enum_values} enum values in all"
                )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex_bounds(pattern, b, "a 'pattern'")
        pattern_props = node.get("patternProperties")
        if isinstance(pattern_props, dict):
            for regex in pattern_props:
                check_regex_bounds(regex, b, "a 'patternProperties' key")


def check_regex_bounds(
    regex: str, bounds: GrammarBounds = DEFAULT_BOUNDS, what: str = "the regex"
) -> None:
    r"""Check the product of nested counted repetitions of a regex (Rust ``regex`` syntax).

    A lexer built from a regex unrolls ``{m,n}`` into about ``n`` copies of what it repeats, so
    ``(x{100}){100}`` and ``x{100}{100}`` cost what ``x{10000}`` does. One pass, linear in the
    regex: it follows groups and escapes (``\{``, ``\p{L}``, ``\x{7F}``) and skips character
    classes; whitespace is skipped, and whitespace inside braces ignored, as the ``x`` flag
    allows (``(?x)a{1 000 000}``), which can only count more, never less; a ``{`` that does not
    open a repetition is left to the compiler.

    Raises:
        BoundError: the product passes ``bounds.max_regex_repeat``.
    """
    limit = bounds.max_regex_repeat
    stack = [1]  # per open group: the largest repetition product inside it so far
    operand = 1  # the product of what a repetition here would repeat (0: nothing)
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c.isspace():
            i += 1
            continue
        if c == "{":
            match = _REPEAT.match(regex, i)
            if match is not None and operand:
                product = _count(match.group(1)) * operand
                if product > limit:
                    raise BoundError(
                        f"{what} repeats {product} times (nested and stacked counted "
                        f"repetitions multiply); at most {limit}"
                    )
                stack[-1] = max(stack[-1], product)
                operand = product  # a repetition of this repetition multiplies again
                i = match.end()
                continue
        if c == "\\":
            if i + 2 < n and regex[i + 1] in "pPxu" and regex[i + 2] == "{":
                close = regex.find("}", i + 3)
                i = n if close < 0 else close + 1
            else:
                i += 2
        elif c == "[":
            i = _skip_class(regex, i)
        elif c == "(":
            stack.append(1)
            i += 1
            operand = 0
            continue
        elif c == ")":
            inner = stack.pop() if len(stack) > 1 else 1
            stack[-1] = max(stack[-1], inner)
            i += 1
            operand = inner
            continue
        elif c == "|":
            i += 1
            operand = 0
            continue
        else:
            i += 1
        operand = 1


_REPEAT = re.compile(r"\{([\d\s]*(?:,[\d\s]*)?)\}")


def _count(body: str) -> int:
    """The larger bound of a repetition's ``m,n`` (whitespace dropped); 10**10 past 9 digits."""
    numbers = [p for p in "".join(body.split()).split(",") if p]
    if not numbers:
        return 0
    return max(int(p) if len(p) <= 9 else 10**10 for p in numbers)


def _skip_class(regex: str, i: int) -> int:
    """The index after the character class opening at ``i`` (nested classes included)."""
    depth, j, n = 0, i, len(regex)
    while j < n:
        c = regex[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            depth += 1
            if j + 1 < n and regex[j + 1] == "^":
                j += 1
            if j + 1 < n and regex[j + 1] == "]":
                j += 1  # a literal ] first in the class
        elif c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n
