"""The ``loraplex`` command line.

Subcommands register here as their parts land (CONTRACT.md lists the full set: ``serve``,
``generate``, ``tenants``, ``keys``, ``db``, ``model``).
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from loraplex.gateway.commands import db, generate, keys, model, serve, tenants


def _version() -> str:
    try:
        return version("loraplex")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level argument parser.

    Returns:
        The parser; each subcommand sets ``func`` on the namespace it parses.
    """
    parser = argparse.ArgumentParser(
        prog="loraplex",
        description="Multi-tenant LoRA and multimodal LLM serving over a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"loraplex {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (serve, generate, model, tenants, keys, db):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit status (0 on success, 2 on a usage error).
    """
    parser = build_parser()
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
