"""The ``loraplex`` command line.

Subcommands register here (docs/cli.md and the README say what each does: ``serve``,
``generate``, ``tenants``, ``keys``, ``db``, ``model``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

COMMANDS = ("serve", "generate", "model", "tenants", "keys", "db")
"""The subcommands, each a module of :mod:`gateway.commands` with ``register(subparsers)``."""


def _version() -> str:
    try:
        return version("loraplex")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0+unknown"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows every option's default.

    argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)``; this one leaves out
    ``(default: None)`` (such an option's help says in words what happens without it) and
    anything whose help already speaks of its default (``%(default)s`` or prose).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def subparsers_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every parser below it (subcommands of subcommands included)."""
    found = [parser]
    for action in parser._actions:  # argparse has no public way to list subparsers
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                found.extend(subparsers_of(child))
    return found


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    """Build the top-level argument parser.

    Args:
        commands: The subcommands to register (their modules are imported here); all of them
            by default.

    Returns:
        The parser; each subcommand sets ``func`` on the namespace it parses.
    """
    parser = argparse.ArgumentParser(
        prog="loraplex",
        description="Multi-tenant LoRA and multimodal LLM serving over a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"loraplex {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands:
        importlib.import_module(f"loraplex.gateway.commands.{name}").register(subparsers)
    for each in subparsers_of(parser):
        each.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit status (0 on success, 2 on a usage error).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # A named command loads only its own module: ``serve`` binds its address before the
    # database commands' imports (SQLAlchemy's models) would have run. Anything else (no
    # command, --help, --version, a typo) gets every command, for the full usage message.
    parser = build_parser(argv[:1] if argv[:1] and argv[0] in COMMANDS else COMMANDS)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stdout)
        return 0
    try:
        return int(func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # bad input: one clear line, no traceback
        print(f"loraplex {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
