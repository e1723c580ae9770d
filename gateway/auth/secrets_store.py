"""Secrets kept in the data directory: the key-hashing secret and the admin key.

Both are created on first use with mode 0600 (``O_CREAT | O_EXCL``, so two processes starting
together agree on one value; the mode set with ``fchmod``, never left to the umask) in a data
directory of mode 0700, and read back afterwards; an existing file or directory that others
could read is tightened.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from loraplex.gateway.settings import PRIVATE_FILE_MODE, private_dir, private_file

SECRET_FILENAME = "secret.key"
ADMIN_KEY_FILENAME = "admin.key"
ADMIN_KEY_PREFIX = "lpx-admin-"
ENV_ADMIN_KEY = "LORAPLEX_ADMIN_KEY"
SECRET_BYTES = 32


def _read_or_create(path: Path, make: Callable[[], str]) -> tuple[str, bool]:
    """The stripped text of ``path``, writing ``make()`` there (0600) first if it is missing."""
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        private_file(path)  # tighten one made readable by others
        value = path.read_text().strip()
        if not value:
            raise ValueError(f"{path} is empty; delete it to have a new one made") from None
        return value, False
    os.fchmod(fd, PRIVATE_FILE_MODE)
    value = make()
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value, True


def load_or_create_secret(data_dir: str | Path) -> bytes:
    """The server secret for key hashes, from ``data_dir/secret.key`` (created on first use).

    Losing or changing this file invalidates every tenant key. Servers sharing one database
    must share this file.

    Raises:
        ValueError: the file exists but holds no valid secret.
    """
    path = Path(data_dir) / SECRET_FILENAME
    text, _ = _read_or_create(path, lambda: secrets.token_hex(SECRET_BYTES))
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path} does not hold a hex secret") from None
    if len(secret) < 16:
        raise ValueError(f"{path}: the secret must be at least 16 bytes")
    return secret


def generate_admin_key() -> str:
    """A fresh admin key, ``lpx-admin-`` + 256 random bits."""
    return ADMIN_KEY_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def load_or_create_admin_key(
    data_dir: str | Path, explicit: str | None = None
) -> tuple[str, Path | None, bool]:
    """The admin key: ``--admin-key``, else ``$LORAPLEX_ADMIN_KEY``, else ``data_dir/admin.key``.

    Args:
        data_dir: The data directory.
        explicit: The ``--admin-key`` flag, if given.

    Returns:
        ``(key, path, created)``: ``path`` is the file the key came from (None when it came from
        the flag or the environment) and ``created`` whether it was made just now. Print the
        path, never the key.
    """
    given = explicit or os.environ.get(ENV_ADMIN_KEY)
    if given:
        return given, None, False
    path = Path(data_dir) / ADMIN_KEY_FILENAME
    key, created = _read_or_create(path, generate_admin_key)
    return key, path, created


def verify_admin_key(presented: str, admin_key: str) -> bool:
    """Whether ``presented`` is the admin key, compared in constant time."""
    return hmac.compare_digest(presented.encode("utf-8"), admin_key.encode("utf-8"))
