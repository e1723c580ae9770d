"""``/admin/*``: tenants, keys and limits (CONTRACT.md)."""

from gateway.domains.admin.controller import AdminController

ROUTES = [AdminController]
