"""Keep keys out of logs: mask ``lpx-`` tokens and bearer credentials in any text."""

from __future__ import annotations

import logging
import re

from loraplex.gateway.auth.keys import DISPLAY_PREFIX_LEN

MASK = "***"
_KEY_RE = re.compile(r"lpx-[A-Za-z0-9_-]+")
_BEARER_RE = re.compile(r"(?i)(bearer\s+)(?!lpx-)[^\s\"',;]+")


def _mask_key(match: re.Match[str]) -> str:
    return match.group(0)[:DISPLAY_PREFIX_LEN] + MASK


def redact(text: str) -> str:
    """``text`` with every key masked.

    ``lpx-`` tokens (tenant and admin keys) keep their display prefix (``lpx-abcd***``), which
    is also what the database shows; any other ``Bearer`` credential (an admin key set by flag or
    environment may have any form) becomes ``Bearer ***``.
    """
    text = _KEY_RE.sub(_mask_key, text)
    return _BEARER_RE.sub(lambda m: m.group(1) + MASK, text)


def _redact_arg(value: object) -> object:
    text = value if isinstance(value, str) else str(value)
    clean = redact(text)
    return value if clean == text else clean


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's formatted message (and its traceback text).

    Install it on handlers: ``handler.addFilter(RedactingFilter())``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place; never drops it.

        The template and each argument are redacted separately, so the record keeps its
        ``args`` (formatters such as uvicorn's access formatter read them); an argument that is
        not a string is replaced by its redacted text only when that text held a key. A message
        that still shows a key once formatted (a key split across arguments) is replaced whole.
        """
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg = redact(str(record.msg))
            if isinstance(record.args, tuple):
                record.args = tuple(_redact_arg(a) for a in record.args)
            elif isinstance(record.args, dict):
                record.args = {k: _redact_arg(v) for k, v in record.args.items()}
            try:
                still = record.getMessage() != clean
            except (TypeError, ValueError):
                still = True
            if still:
                record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True
