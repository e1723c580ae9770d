"""``loraplex keys create TENANT_ID``, ``keys list TENANT_ID`` and ``keys revoke KEY_ID``.

``keys list`` shows what identifies a key (its id, the display prefix, when it was made and
revoked), never the key or its hash: the plaintext exists only in ``create``'s output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from loraplex.gateway.auth.secrets_store import load_or_create_secret
from loraplex.gateway.commands.db import CLI_ERRORS, add_db_args, fail, migrated_session, resolve
from loraplex.gateway.commands.output import add_field_arg, emit
from loraplex.gateway.services.keys import create_key, list_keys, revoke_key
from loraplex.gateway.services.tenants import get_tenant

CREATE_FIELDS = ("id", "api_key")
LIST_FIELDS = ("id", "prefix", "created_at", "revoked_at")


def register(subparsers) -> None:
    """Add the ``keys`` command group."""
    keys = subparsers.add_parser("keys", help="manage tenant API keys")
    sub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND", required=True)
    create = sub.add_parser("create", help='issue a key; prints {"id", "api_key"} (the key, once)')
    create.add_argument("tenant_id", help="the tenant's id (loraplex tenants list)")
    add_field_arg(create, CREATE_FIELDS)
    add_db_args(create)
    create.set_defaults(func=_create)
    listing = sub.add_parser(
        "list",
        help='a tenant\'s keys, oldest first: one {"id", "prefix", "created_at", "revoked_at"} '
        "per line (never the key itself)",
    )
    listing.add_argument("tenant_id", help="the tenant's id (loraplex tenants list)")
    add_field_arg(listing, LIST_FIELDS)
    add_db_args(listing)
    listing.set_defaults(func=_list)
    revoke = sub.add_parser("revoke", help='revoke a key; prints {"id", "revoked": true}')
    revoke.add_argument("key_id", help="the key's id (loraplex keys list TENANT_ID)")
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
    emit([out], args.field)
    return 0


def _list(args: argparse.Namespace) -> int:
    _, url = resolve(args)

    async def run() -> list[dict[str, Any]]:
        async with migrated_session(url) as session:
            await get_tenant(session, args.tenant_id)  # NotFoundError for an unknown tenant
            return [
                {
                    "id": k.id,
                    "prefix": k.prefix,
                    "created_at": k.created_at.isoformat(),
                    "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
                }
                for k in await list_keys(session, args.tenant_id)
            ]

    try:
        out = asyncio.run(run())
    except CLI_ERRORS as exc:
        return fail("keys list", exc)
    emit(out, args.field)
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
