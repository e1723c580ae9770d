"""``loraplex tenants create NAME``: a tenant and its first API key (shown once)."""

from __future__ import annotations

import argparse
import asyncio
import json

from loraplex.gateway.auth.secrets_store import load_or_create_secret
from loraplex.gateway.commands.db import CLI_ERRORS, add_db_args, fail, migrated_session, resolve
from loraplex.gateway.services.tenants import create_tenant_with_key


def register(subparsers) -> None:
    """Add the ``tenants`` command group."""
    tenants = subparsers.add_parser("tenants", help="manage tenants")
    sub = tenants.add_subparsers(dest="tenants_command", metavar="SUBCOMMAND", required=True)
    create = sub.add_parser(
        "create", help='create a tenant; prints {"id", "name", "api_key"} (the key, once)'
    )
    create.add_argument("name")
    add_db_args(create)
    create.set_defaults(func=_create)


def _create(args: argparse.Namespace) -> int:
    directory, url = resolve(args)

    async def run() -> dict[str, str]:
        secret = load_or_create_secret(directory)
        async with migrated_session(url) as session:
            tenant, key = await create_tenant_with_key(session, args.name, secret)
            return {"id": tenant.id, "name": tenant.name, "api_key": key.api_key}

    try:
        out = asyncio.run(run())
    except CLI_ERRORS as exc:
        return fail("tenants create", exc)
    print(json.dumps(out))
    return 0
