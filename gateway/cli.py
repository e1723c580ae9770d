"""The ``loraplex`` command line.

Subcommands register here as their parts land (CONTRACT.md lists the full set: ``serve``,
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
