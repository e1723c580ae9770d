import hmac
import logging
import stat
from hashlib import sha256

import pytest

from loraplex.gateway.auth.keys import (
    KEY_PREFIX,
    display_prefix,
    generate_key,
    hash_key,
    looks_like_key,
    verify_key,
)
from loraplex.gateway.auth.redact import RedactingFilter, redact
from loraplex.gateway.auth.secrets_store import (
    ADMIN_KEY_PREFIX,
    load_or_create_admin_key,
    load_or_create_secret,
    verify_admin_key,
)

SECRET = b"k" * 32


def test_key_format_and_entropy():
    keys = {generate_key() for _ in range(1000)}
    assert len(keys) == 1000
    for key in keys:
        assert key.startswith(KEY_PREFIX)
        assert looks_like_key(key)
        # 43 URL-safe base64 characters carry 256 bits (at least the 128 asked for)
        assert len(key) - len(KEY_PREFIX) == 43
    # All 64 URL-safe base64 characters occur: the random part is not drawn from a subset.
    alphabet = set("".join(k[len(KEY_PREFIX) :] for k in keys))
    assert len(alphabet) == 64


def test_hash_is_hmac_sha256_hex():
    key = generate_key()
    expected = hmac.new(SECRET, key.encode(), sha256).hexdigest()
    assert hash_key(key, SECRET) == expected
    assert len(expected) == 64
    assert hash_key(key, b"other" * 8) != expected


def test_verify_uses_constant_time_compare(monkeypatch):
    key = generate_key()
    digest = hash_key(key, SECRET)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(
        "loraplex.gateway.auth.keys.hmac.compare_digest", lambda a, b: calls.append(1) or real(a, b)
    )
    assert verify_key(key, digest, SECRET)
    assert not verify_key(generate_key(), digest, SECRET)
    assert not verify_key(key, digest, b"x" * 32)
    assert len(calls) == 3


def test_display_prefix():
    key = generate_key()
    assert display_prefix(key) == key[:8]
    assert display_prefix(key).startswith("lpx-")


def test_secret_is_created_once_with_mode_0600(tmp_path):
    secret = load_or_create_secret(tmp_path / "data")
    path = tmp_path / "data" / "secret.key"
    assert len(secret) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(tmp_path / "data") == secret


def test_bad_secret_file_is_refused(tmp_path):
    (tmp_path / "secret.key").write_text("not hex\n")
    with pytest.raises(ValueError):
        load_or_create_secret(tmp_path)


def test_admin_key_from_file_flag_or_env(tmp_path, monkeypatch):
    monkeypatch.delenv("LORAPLEX_ADMIN_KEY", raising=False)
    key, path, created = load_or_create_admin_key(tmp_path)
    assert created and path == tmp_path / "admin.key"
    assert key.startswith(ADMIN_KEY_PREFIX) and len(key) >= len(ADMIN_KEY_PREFIX) + 43
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_admin_key(tmp_path) == (key, path, False)

    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", "from-env")
    assert load_or_create_admin_key(tmp_path) == ("from-env", None, False)
    assert load_or_create_admin_key(tmp_path, "from-flag") == ("from-flag", None, False)
    assert verify_admin_key("from-flag", "from-flag")
    assert not verify_admin_key("from-fla", "from-flag")


def test_redact_masks_keys_and_bearer_tokens():
    key, admin = generate_key(), ADMIN_KEY_PREFIX + "abcdefghijklmnop"
    text = f"auth {key} then {admin}; header Authorization: Bearer s3cr3t-admin, ok"
    clean = redact(text)
    assert key not in clean and admin not in clean and "s3cr3t-admin" not in clean
    assert key[:8] + "***" in clean
    assert "Bearer ***" in clean
    assert redact("no secrets here") == "no secrets here"


def test_redacting_filter(caplog):
    key = generate_key()
    logger = logging.getLogger("loraplex.test.redact")
    logger.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("request with key %s", key)
        try:
            raise RuntimeError(f"bad key {key}")
        except RuntimeError:
            logger.exception("failed")
    assert key not in caplog.text
    assert key[:8] + "***" in caplog.text


def test_redacting_filter_keeps_args_for_formatters_that_read_them():
    """uvicorn's access formatter unpacks ``record.args``: a redacted record keeps them."""
    from uvicorn.logging import AccessFormatter

    key = generate_key()
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", f"/v1/models?key={key}", "1.1", 200), None,
    )  # fmt: skip
    assert RedactingFilter().filter(record)
    assert isinstance(record.args, tuple) and record.args[4] == 200
    line = AccessFormatter(fmt="%(client_addr)s %(request_line)s %(status_code)s").format(record)
    assert key not in line and key[:8] + "***" in line and "200" in line


def test_redacting_filter_replaces_a_message_whose_secret_spans_arguments():
    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "Authorization: %s %s", ("Bearer", "s3cr3t-admin"), None
    )
    RedactingFilter().filter(record)
    assert "s3cr3t-admin" not in record.getMessage() and "Bearer ***" in record.getMessage()
