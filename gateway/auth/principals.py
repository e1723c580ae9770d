"""Who a request comes from, once its key is verified (``request.user``)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.gateway.services.tenants import TenantLimits


@dataclass(frozen=True)
class TenantPrincipal:
    """The caller behind a valid tenant key.

    Attributes:
        tenant_id: The tenant (also the engine requests' cache salt).
        tenant_name: Its name.
        key_id: The key's id (usage rows, rate limits, logs).
        limits: The tenant's own limits (None fields: the server defaults apply).
    """

    tenant_id: str
    tenant_name: str
    key_id: str
    limits: TenantLimits


@dataclass(frozen=True)
class AdminPrincipal:
    """The caller presented the admin key."""
