"""``/health`` and ``/metrics`` (no authentication)."""

from loraplex.gateway.domains.system.controller import health, metrics

ROUTES = [health, metrics]
