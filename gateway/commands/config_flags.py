"""Command-line flags generated from a frozen dataclass's fields and attribute docstrings.

A config field is written once: its name, type and default in the dataclass, its meaning in the
docstring under it. This module turns each field into an argparse flag (vLLM's ``EngineArgs``
does the same with its config classes): ``block_size`` becomes ``--block-size``, a ``Literal``
gives ``choices``, a ``bool`` a ``--x/--no-x`` pair, ``X | None`` an optional ``X``, and the
docstring is the help, with the default appended. What the field alone cannot say (another
flag name, a metavar, a parser such as sizes like ``4GiB``) comes from a :class:`FlagSpec`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class FlagSpec:
    """What a field's flag needs beyond the field itself.

    Attributes:
        flag: The flag's name (default: ``--`` and the field name with dashes).
        metavar: The value's name in ``--help``.
        parse: The argparse ``type`` (default: from the field's annotation).
        show_default: How the default reads in the help (default: ``str``), or None to leave
            the default out of the help.
        aliases: Other names the flag keeps answering to (an older name users rely on).
    """

    flag: str | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    show_default: Callable[[Any], str] | None = str
    aliases: tuple[str, ...] = ()


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls``, whitespace collapsed.

    Read from the class's source with :mod:`ast` (a string expression right after an annotated
    assignment, PEP 257's attribute docstring).

    Raises:
        OSError: the class's source is not available.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


_LITERAL = re.compile(r"``([^`]+)``")


def help_text(doc: str, flags: dict[str, str]) -> str:
    """A docstring as ``--help`` text, in the style of the hand-written flags' help.

    ````field```` becomes its flag and other ````x```` x; a capitalised first word is
    lowercased ("Tokens per block." -> "tokens per block", "CUDA: ..." stays) and one final full
    stop dropped, as ``(default: ...)`` may follow.
    """
    text = _LITERAL.sub(lambda m: flags.get(m.group(1), m.group(1)), doc).removesuffix(".")
    first = re.match(r"[A-Z][a-z]+\b", text)
    if first:
        text = first.group(0).lower() + text[first.end() :]
    return text


def flag_name(field: str, spec: FlagSpec | None) -> str:
    """The flag of a field: the spec's, else ``--`` and the name with dashes."""
    if spec is not None and spec.flag:
        return spec.flag
    return "--" + field.replace("_", "-")


def _unwrap_optional(tp: Any) -> Any:
    """``X`` for ``X | None`` (or ``Optional[X]``), else ``tp``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _argparse_kwargs(tp: Any, default: Any, spec: FlagSpec | None) -> dict[str, Any]:
    """``add_argument`` keywords for a field of annotation ``tp``.

    Raises:
        TypeError: an annotation this module cannot make a flag of (and no ``parse`` given).
    """
    tp = _unwrap_optional(tp)
    if spec is not None and spec.parse is not None:
        return {"type": spec.parse}
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(tp) is Literal:
        choices = list(typing.get_args(tp))
        return {"choices": choices, "type": type(choices[0])}
    if tp in (int, float, str):
        return {"type": tp}
    raise TypeError(f"no flag for a field of type {tp!r}: give a FlagSpec with parse")


def add_config_flags(
    group: Any,
    cls: type,
    fields: Iterable[str],
    specs: dict[str, FlagSpec] | None = None,
) -> None:
    """Add one flag per named field of the dataclass ``cls`` to an argparse group or parser.

    The flag's ``dest`` is the field's name, its default the field's default, its help the
    field's attribute docstring (a field named in double backticks there reads as its flag;
    ``%`` escaped) and ``(default: ...)`` unless the default is None (the docstring says what
    unset means).

    Raises:
        KeyError: a field without an attribute docstring or not a field of ``cls``.
        TypeError: a field whose type makes no flag.
    """
    specs = specs or {}
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    flags = {name: flag_name(name, specs.get(name)) for name in by_name}
    for name in fields:
        f = by_name[name]
        spec = specs.get(name)
        default = f.default
        text = help_text(docs[name], flags).replace("%", "%%")
        show = spec.show_default if spec is not None else str
        if default is not None and show is not None:
            shown = "on" if default is True else "off" if default is False else show(default)
            text += f" (default: {shown})"
        kwargs = _argparse_kwargs(hints[name], default, spec)
        if spec is not None and spec.metavar:
            kwargs["metavar"] = spec.metavar
        aliases = spec.aliases if spec is not None else ()
        group.add_argument(flags[name], *aliases, dest=name, default=default, help=text, **kwargs)


def config_kwargs(args: argparse.Namespace, fields: Iterable[str]) -> dict[str, Any]:
    """The parsed values of the named fields' flags, as the dataclass's keyword arguments."""
    return {name: getattr(args, name) for name in fields}
