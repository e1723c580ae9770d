"""``--help`` of every command and subcommand: help text and the default for every option."""

import argparse
import subprocess
import sys

import pytest

from loraplex.gateway.cli import HelpFormatter, build_parser, subparsers_of

PARSERS = subparsers_of(build_parser())


def _options(parser):
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        yield action


def test_the_walk_finds_every_command():
    progs = {p.prog for p in PARSERS}
    for command in (
        "serve",
        "generate",
        "model init-tiny",
        "tenants create",
        "tenants list",
        "keys create",
        "keys list",
        "keys revoke",
        "db upgrade",
    ):
        assert f"loraplex {command}" in progs


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.prog)
def test_every_option_has_help_and_shows_its_default(parser):
    assert parser.formatter_class is HelpFormatter
    formatter = parser._get_formatter()
    missing, no_default = [], []
    for action in _options(parser):
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append(name)
            continue
        if not action.option_strings or action.required:
            continue  # a positional or a required option has no default to show
        shown = formatter._expand_help(action)  # what --help prints for it
        if "default" not in shown.lower():
            no_default.append(name)
    assert not missing, f"{parser.prog}: options without help text: {missing}"
    assert not no_default, (
        f"{parser.prog}: options whose default --help does not show: {no_default}"
    )


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.prog)
def test_help_renders(parser):
    text = parser.format_help()  # raises on a bad %-format in any help string
    for action in _options(parser):
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            if "%(default)" not in (action.help or "") and "default" not in (action.help or ""):
                assert f"(default: {action.default})" in text, action.option_strings


def test_serve_help_from_the_installed_command():
    out = subprocess.run(
        [sys.executable, "-m", "loraplex.gateway.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())  # argparse wraps to the terminal's width
    assert "--block-size BLOCK_SIZE tokens per KV cache block (default: 16)" in flat
    assert "--port PORT TCP port to listen on (default: 8000)" in flat
    assert "(default: None)" not in flat
