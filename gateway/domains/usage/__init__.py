"""The usage domain of the HTTP API (docs/usage.md): ``GET /v1/usage``."""

from loraplex.gateway.domains.usage.controller import get_usage

ROUTES = [get_usage]
