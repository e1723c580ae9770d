"""``/health`` (no key) and ``/metrics`` (the admin key)."""

from loraplex.gateway.domains.system.controller import health, metrics

ROUTES = [health, metrics]
