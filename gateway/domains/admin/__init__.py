"""``/admin/*``: tenants, keys and limits (the admin key only)."""

from loraplex.gateway.domains.admin.controller import AdminController

ROUTES = [AdminController]
