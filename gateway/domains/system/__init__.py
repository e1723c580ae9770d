"""``/health`` and ``/metrics`` (no authentication)."""

from gateway.domains.system.controller import health, metrics

ROUTES = [health, metrics]
