"""Tenant API keys: generation, hashing, constant-time verification.

A key is ``lpx-`` followed by 43 URL-safe characters from ``secrets.token_urlsafe(32)``: 256 bits
of randomness. The database holds only ``HMAC-SHA-256(server secret, key)`` in hex, so a leaked
database (without the data directory's ``secret.key``) cannot be used to check guesses. Because
the key itself is uniformly random, the hash is a safe lookup index: finding the row by hash
reveals nothing about other keys; the match is confirmed with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

KEY_PREFIX = "lpx-"
KEY_RANDOM_BYTES = 32  # 256 bits; the issue asks for at least 128
DISPLAY_PREFIX_LEN = 8  # "lpx-" and 4 random characters
MAX_KEY_LEN = 256  # longer bearer tokens are refused before hashing

_KEY_RE = re.compile(r"^lpx-[A-Za-z0-9_-]{43}$")


def generate_key() -> str:
    """A fresh tenant key, ``lpx-`` + 43 URL-safe base64 characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def looks_like_key(candidate: str) -> bool:
    """Whether ``candidate`` has the shape of a key ``generate_key`` makes."""
    return bool(_KEY_RE.fullmatch(candidate))


def hash_key(key: str, secret: bytes) -> str:
    """``HMAC-SHA-256(secret, key)`` as 64 lowercase hex digits: the stored form of a key."""
    return hmac.new(secret, key.encode("utf-8"), hashlib.sha256).hexdigest()


def verify_key(key: str, key_hash: str, secret: bytes) -> bool:
    """Whether ``key`` hashes to ``key_hash``, compared in constant time."""
    return hmac.compare_digest(hash_key(key, secret), key_hash)


def display_prefix(key: str) -> str:
    """The part of a key that may be shown and stored in clear (``lpx-abcd``)."""
    return key[:DISPLAY_PREFIX_LEN]
