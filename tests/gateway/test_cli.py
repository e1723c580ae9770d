"""``loraplex db``, ``tenants`` and ``keys``, end to end on a fresh data directory."""

import argparse
import json
import subprocess
import sys
from datetime import datetime

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
    assert set(tenant) == {"id", "name", "api_key", "key_id"} and tenant["name"] == "acme"
    assert tenant["api_key"].startswith("lpx-")
    assert auth(data, tenant["api_key"]) == (tenant["id"], tenant["key_id"])

    key = run_json(capsys, "keys", "create", tenant["id"], "--data-dir", data)
    assert set(key) == {"id", "api_key"}
    assert auth(data, key["api_key"]) == (tenant["id"], key["id"])

    revoked = run_json(capsys, "keys", "revoke", key["id"], "--data-dir", data)
    assert revoked == {"id": key["id"], "revoked": True}
    assert auth(data, key["api_key"]) is None
    assert auth(data, tenant["api_key"]) is not None  # the other key still works
    # revoking twice is fine
    assert run_json(capsys, "keys", "revoke", key["id"], "--data-dir", data) == revoked


def run_lines(capsys, *argv):
    assert cli(*argv) == 0
    return capsys.readouterr().out.splitlines()


def test_tenants_list(tmp_path, capsys):
    data = str(tmp_path / "data")
    assert run_lines(capsys, "tenants", "list", "--data-dir", data) == []
    acme = run_json(capsys, "tenants", "create", "acme", "--data-dir", data)
    globex = run_json(capsys, "tenants", "create", "globex", "--data-dir", data)
    rows = [json.loads(line) for line in run_lines(capsys, "tenants", "list", "--data-dir", data)]
    assert [(r["id"], r["name"]) for r in rows] == [(acme["id"], "acme"), (globex["id"], "globex")]
    assert all(set(r) == {"id", "name", "created_at"} for r in rows)
    for r in rows:
        assert datetime.fromisoformat(r["created_at"]).tzinfo is not None
    only = run_lines(capsys, "tenants", "list", "--name", "globex", "--data-dir", data)
    assert [json.loads(line) for line in only] == rows[1:]
    assert run_lines(capsys, "tenants", "list", "--name", "nobody", "--data-dir", data) == []
    ids = run_lines(capsys, "tenants", "list", "--field", "id", "--data-dir", data)
    assert ids == [acme["id"], globex["id"]]
    name_id = ("tenants", "list", "--name", "acme", "--field", "id", "--data-dir", data)
    assert run_lines(capsys, *name_id) == [acme["id"]]


def test_keys_list_shows_ids_and_never_the_key(tmp_path, capsys):
    data = str(tmp_path / "data")
    tenant = run_json(capsys, "tenants", "create", "acme", "--data-dir", data)
    other = run_json(capsys, "tenants", "create", "globex", "--data-dir", data)
    second = run_json(capsys, "keys", "create", tenant["id"], "--data-dir", data)
    run_json(capsys, "keys", "revoke", tenant["key_id"], "--data-dir", data)
    assert cli("keys", "list", tenant["id"], "--data-dir", data) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [tenant["key_id"], second["id"]]  # globex's key not here
    assert all(set(r) == {"id", "prefix", "created_at", "revoked_at"} for r in rows)
    assert rows[0]["revoked_at"] is not None and rows[1]["revoked_at"] is None
    assert datetime.fromisoformat(rows[0]["revoked_at"]) >= datetime.fromisoformat(
        rows[0]["created_at"]
    )
    for key, row in zip((tenant["api_key"], second["api_key"]), rows, strict=True):
        assert key.startswith(row["prefix"]) and len(row["prefix"]) < len(key) // 2
        assert key not in out and key[len(row["prefix"]) :] not in out  # no secret printed
    fields = ("keys", "list", tenant["id"], "--data-dir", data, "--field")
    assert run_lines(capsys, *fields, "id") == [tenant["key_id"], second["id"]]
    assert run_lines(capsys, *fields, "revoked_at")[1] == "null"
    assert run_lines(capsys, "keys", "list", other["id"], "--data-dir", data, "--field", "id") == [
        other["key_id"]
    ]


def test_field_prints_one_value_for_the_shell(tmp_path, capsys):
    data = str(tmp_path / "data")
    (key,) = run_lines(
        capsys, "tenants", "create", "acme", "--field", "api_key", "--data-dir", data
    )
    tenant_id, key_id = auth(data, key)
    (second,) = run_lines(
        capsys, "keys", "create", tenant_id, "--field", "api_key", "--data-dir", data
    )
    assert auth(data, second)[0] == tenant_id and auth(data, second)[1] != key_id
    (new_id,) = run_lines(capsys, "keys", "create", tenant_id, "--field", "id", "--data-dir", data)
    assert new_id not in (key_id, auth(data, second)[1])
    with pytest.raises(SystemExit):  # argparse refuses a field the output does not have
        cli("tenants", "create", "x", "--field", "secret", "--data-dir", data)


def test_errors_exit_1_with_one_line(tmp_path, capsys):
    data = str(tmp_path / "data")
    run_json(capsys, "tenants", "create", "acme", "--data-dir", data)
    cases = [
        (("tenants", "create", "acme"), "taken"),
        (("keys", "create", "no-such-tenant"), "no tenant"),
        (("keys", "revoke", "no-such-key"), "no key"),
        (("keys", "list", "no-such-tenant"), "no tenant"),
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


@pytest.mark.slow
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
