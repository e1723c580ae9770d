"""``/admin/*``: tenants, keys and limits (CONTRACT.md)."""

from loraplex.gateway.domains.admin.controller import AdminController

ROUTES = [AdminController]
