"""``loraplex tenants create NAME`` (a tenant and its first key, shown once), ``tenants list``."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from loraplex.gateway.auth.secrets_store import load_or_create_secret
from loraplex.gateway.commands.db import CLI_ERRORS, add_db_args, fail, migrated_session, resolve
from loraplex.gateway.commands.output import add_field_arg, emit
from loraplex.gateway.services.tenants import create_tenant_with_key, list_tenants

CREATE_FIELDS = ("id", "name", "api_key", "key_id")
LIST_FIELDS = ("id", "name", "created_at")


def register(subparsers) -> None:
    """Add the ``tenants`` command group."""
    tenants = subparsers.add_parser("tenants", help="manage tenants")
    sub = tenants.add_subparsers(dest="tenants_command", metavar="SUBCOMMAND", required=True)
    create = sub.add_parser(
        "create",
        help='create a tenant and its first key; prints {"id", "name", "api_key", "key_id"} '
        "(the key, once)",
    )
    create.add_argument("name", help="the tenant's name (unique, printable, at most 128 chars)")
    add_field_arg(create, CREATE_FIELDS)
    add_db_args(create)
    create.set_defaults(func=_create)
    listing = sub.add_parser(
        "list", help='every tenant, oldest first: one {"id", "name", "created_at"} per line'
    )
    listing.add_argument(
        "--name", default=None, help="only the tenant of this name (default: every tenant)"
    )
    add_field_arg(listing, LIST_FIELDS)
    add_db_args(listing)
    listing.set_defaults(func=_list)


def _create(args: argparse.Namespace) -> int:
    directory, url = resolve(args)

    async def run() -> dict[str, str]:
        secret = load_or_create_secret(directory)
        async with migrated_session(url) as session:
            tenant, key = await create_tenant_with_key(session, args.name, secret)
            return {"id": tenant.id, "name": tenant.name, "api_key": key.api_key, "key_id": key.id}

    try:
        out = asyncio.run(run())
    except CLI_ERRORS as exc:
        return fail("tenants create", exc)
    emit([out], args.field)
    return 0


def _list(args: argparse.Namespace) -> int:
    _, url = resolve(args)

    async def run() -> list[dict[str, Any]]:
        async with migrated_session(url) as session:
            return [
                {"id": t.id, "name": t.name, "created_at": t.created_at.isoformat()}
                for t in await list_tenants(session)
                if args.name is None or t.name == args.name
            ]

    try:
        out = asyncio.run(run())
    except CLI_ERRORS as exc:
        return fail("tenants list", exc)
    emit(out, args.field)
    return 0
