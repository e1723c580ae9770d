"""``loraplex keys create TENANT_ID`` and ``loraplex keys revoke KEY_ID``."""

from __future__ import annotations

import argparse
import asyncio
import json

from loraplex.gateway.auth.secrets_store import load_or_create_secret
from loraplex.gateway.commands.db import CLI_ERRORS, add_db_args, fail, migrated_session, resolve
from loraplex.gateway.services.keys import create_key, revoke_key


def register(subparsers) -> None:
    """Add the ``keys`` command group."""
    keys = subparsers.add_parser("keys", help="manage tenant API keys")
    sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND", required=True)
    create = sub.add_parser("create", help='issue a key; prints {"id", "api_key"} (the key, once)')
    create.add_argument("tenant_id")
    add_db_args(create)
    create.set_defaults(func=_create)
    revoke = sub.add_parser("revoke", help='revoke a key; prints {"id", "revoked": true}')
    revoke.add_argument("key_id")
    add_db_args(revoke)
    revoke.set_defaults(func=_revoke)


def _create(args: argparse.Namespace) -> int:
    directory, url = resolve(args)

    async def run() -> dict[str, str]:
        secret = load_or_create_secret(directory)
        async with migrated_session(url) as session:
            key = await create_key(session, args.tenant_id, secret)
            return {"id": key.id, "api_key": key.api_key}

    try:
        out = asyncio.run(run())
    except CLI_ERRORS as exc:
        return fail("keys create", exc)
    print(json.dumps(out))
    return 0


def _revoke(args: argparse.Namespace) -> int:
    _, url = resolve(args)

    async def run() -> dict[str, object]:
        async with migrated_session(url) as session:
            key = await revoke_key(session, args.key_id)
            return {"id": key.id, "revoked": True}

    try:
        out = asyncio.run(run())
    except CLI_ERRORS as exc:
        return fail("keys revoke", exc)
    print(json.dumps(out))
    return 0
