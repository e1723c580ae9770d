"""``loraplex db``, ``tenants`` and ``keys``, end to end on a fresh data directory."""

import argparse
import json
import subprocess
import sys

import pytest

from loraplex.gateway.auth.secrets_store import load_or_create_secret
from loraplex.gateway.commands import db, keys, tenants
from loraplex.gateway.db.session import db_url
from loraplex.gateway.services.keys import authenticate
from tests.gateway.conftest import with_db


def cli(*argv):
    parser = argparse.ArgumentParser(prog="loraplex")
    sub = parser.add_subparsers(dest="command")
    for module in (db, tenants, keys):
        module.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def run_json(capsys, *argv):
    assert cli(*argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def auth(data, api_key):
    secret = load_or_create_secret(data)

    async def body(sessions):
        async with sessions() as s:
            who = await authenticate(s, api_key, secret)
            return None if who is None else (who.tenant.id, who.key.id)

    return with_db(db_url(data), body)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("LORAPLEX_DATA_DIR", "LORAPLEX_DB_URL", "LORAPLEX_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)


def test_db_upgrade_is_idempotent(tmp_path, capsys):
    data = str(tmp_path / "data")
    from loraplex.gateway.db.migrate import head_revision

    first = run_json(capsys, "db", "upgrade", "--data-dir", data)
    assert first == {"revision": head_revision(), "backend": "sqlite"}
    assert run_json(capsys, "db", "upgrade", "--data-dir", data) == first
    assert (tmp_path / "data" / "loraplex.db").exists()


def test_tenants_and_keys_end_to_end(tmp_path, capsys):
    data = str(tmp_path / "data")
    tenant = run_json(capsys, "tenants", "create", "acme", "--data-dir", data)
    assert set(tenant) == {"id", "name", "api_key"} and tenant["name"] == "acme"
    assert tenant["api_key"].startswith("lpx-")
    assert auth(data, tenant["api_key"])[0] == tenant["id"]

    key = run_json(capsys, "keys", "create", tenant["id"], "--data-dir", data)
    assert set(key) == {"id", "api_key"}
    assert auth(data, key["api_key"]) == (tenant["id"], key["id"])

    revoked = run_json(capsys, "keys", "revoke", key["id"], "--data-dir", data)
    assert revoked == {"id": key["id"], "revoked": True}
    assert auth(data, key["api_key"]) is None
    assert auth(data, tenant["api_key"]) is not None  # the other key still works
    # revoking twice is fine
    assert run_json(capsys, "keys", "revoke", key["id"], "--data-dir", data) == revoked


def test_errors_exit_1_with_one_line(tmp_path, capsys):
    data = str(tmp_path / "data")
    run_json(capsys, "tenants", "create", "acme", "--data-dir", data)
    cases = [
        (("tenants", "create", "acme"), "taken"),
        (("keys", "create", "no-such-tenant"), "no tenant"),
        (("keys", "revoke", "no-such-key"), "no key"),
    ]
    for argv, message in cases:
        assert cli(*argv, "--data-dir", data) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert message in captured.err and "Traceback" not in captured.err
        assert captured.err.count("\n") == 1


def test_env_data_dir_and_db_url(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    other_db = tmp_path / "elsewhere.db"
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(data))
    monkeypatch.setenv("LORAPLEX_DB_URL", f"sqlite:///{other_db}")
    tenant = run_json(capsys, "tenants", "create", "acme")
    assert other_db.exists() and not (data / "loraplex.db").exists()
    assert (data / "secret.key").exists()
    # the flag wins over the environment
    flag_db = tmp_path / "flag.db"
    run_json(capsys, "tenants", "create", "acme", "--db-url", f"sqlite:///{flag_db}")
    assert flag_db.exists()
    assert tenant["id"]


def test_installed_cli_when_registered(tmp_path):
    from loraplex.gateway.cli import build_parser

    choices = build_parser()._subparsers._group_actions[0].choices
    if "tenants" not in choices:
        pytest.skip("gateway/cli.py does not register the tenants command yet")
    cmd = [sys.executable, "-m", "loraplex.gateway.cli"]
    data = ["--data-dir", str(tmp_path)]
    out = subprocess.run(cmd + ["tenants", "create", "acme"] + data, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    tenant = json.loads(out.stdout)
    out = subprocess.run(
        cmd + ["keys", "create", tenant["id"]] + data, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    key = json.loads(out.stdout)
    out = subprocess.run(cmd + ["keys", "revoke", key["id"]] + data, capture_output=True, text=True)
    assert json.loads(out.stdout) == {"id": key["id"], "revoked": True}
