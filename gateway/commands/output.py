"""How the ``tenants`` and ``keys`` commands print: one JSON object per line, or one field.

Every object these commands print is flat (strings, nulls, booleans). ``--field NAME`` prints
that field's value alone, one line per object, so a shell can capture it
(``export KEY=$(loraplex tenants create acme --field api_key)``): strings as they are, anything
else as JSON (``null``, ``true``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from typing import Any


def add_field_arg(parser: argparse.ArgumentParser, fields: Sequence[str]) -> None:
    """Add ``--field NAME`` (one of ``fields``) to a subcommand."""
    parser.add_argument(
        "--field",
        choices=list(fields),
        default=None,
        help="print only this field's value, one line per object (default: whole JSON objects)",
    )


def emit(objects: Iterable[dict[str, Any]], field: str | None) -> None:
    """Print ``objects`` as JSON lines, or only their ``field`` (see the module docstring)."""
    for obj in objects:
        if field is None:
            print(json.dumps(obj))
        else:
            value = obj[field]
            print(value if isinstance(value, str) else json.dumps(value))
