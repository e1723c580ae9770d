"""The OpenAPI schema ``/openapi.json`` serves: Litestar's, with the keys and the errors made true.

Litestar generates the paths, parameters and body schemas from the route handlers; what it
cannot know is added here (issue 31):

* **Security.** Two HTTP bearer schemes (``components.securitySchemes``): ``tenant_key`` (a
  tenant's ``lpx-...`` key) and ``admin_key``. Each operation names the one its route takes
  (``gateway.auth.middleware``: routes marked ``exclude_from_auth`` take none, ``opt=ADMIN_ONLY``
  the admin key, every other the tenant key), so Swagger UI's *Authorize* sends the right key.
* **Errors.** Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``
  (``gateway/errors.py``; ``components.schemas.Error``). Litestar documents its own
  ``ValidationException`` body (``status_code``, ``detail``, ``extra``) for a 400, which no
  client ever gets; each operation's error responses are replaced by the statuses its route
  can answer, each with that body, and a ``default`` response says any other error has it too.
"""

from __future__ import annotations

import copy
from typing import Any

from litestar import Litestar
from litestar.routes import HTTPRoute

from loraplex.gateway.auth.middleware import KEY_AREA

EXCLUDE_FROM_AUTH = "exclude_from_auth"
ERROR_REF = {"$ref": "#/components/schemas/Error"}

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's error body, on every error of every route (docs/api.md).",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "What went wrong."},
                "type": {
                    "type": "string",
                    "description": "OpenAI's error type: invalid_request_error, "
                    "authentication_error, permission_error, rate_limit_error, server_error, "
                    "service_unavailable.",
                },
                "param": {
                    "type": ["string", "null"],
                    "description": "The request field at fault, if any.",
                },
                "code": {
                    "type": ["string", "null"],
                    "description": "A machine-readable code (model_not_found, overloaded, ...).",
                },
            },
        }
    },
    "examples": [
        {
            "error": {
                "message": "missing API key: send 'Authorization: Bearer <key>'",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    ],
}

SECURITY_SCHEMES: dict[str, Any] = {
    "tenant_key": {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key (`lpx-...`): `loraplex tenants create NAME`. "
        "Every route but /health, /version, /metrics and /admin/* takes it.",
    },
    "admin_key": {
        "type": "http",
        "scheme": "bearer",
        "description": "The admin key (`.loraplex/admin.key`): /admin/* and /metrics only.",
    },
}

# status -> what it means on the routes that answer it
_ERRORS = {
    "400": "Invalid request (bad JSON, a field out of range, ...): `param` names the field.",
    "401": "Missing, malformed, unknown or revoked key.",
    "403": "The wrong kind of key: the admin key on a tenant route, or a tenant key on an "
    "admin route.",
    "429": "Rate limited, or too many failed keys from this address (`Retry-After`).",
    "503": "The database or the engine is unavailable, or the server is overloaded "
    "(`Retry-After`).",
}
_DEFAULT = "Any other error (404 unknown model, adapter or route, 409, 413, ...), same body."
_BODY_METHODS = {"post", "put", "patch"}


def route_keys(app: Litestar) -> dict[tuple[str, str], str | None]:
    """Which key each operation takes: ``(path, method)`` -> ``tenant_key``, ``admin_key``, None.

    Read from the route handlers' ``opt`` as the auth middleware reads it (``method`` lowercase,
    ``path`` as the schema's ``paths`` keys are).
    """
    keys: dict[tuple[str, str], str | None] = {}
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (handler, _) in route.route_handler_map.items():
            opt = handler.opt
            if opt.get(EXCLUDE_FROM_AUTH):
                key = None
            elif opt.get(KEY_AREA) == "admin":
                key = "admin_key"
            else:
                key = "tenant_key"
            keys[(route.path_format or "/", method.lower())] = key
    return keys


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


def document(schema: dict[str, Any], app: Litestar) -> dict[str, Any]:
    """Litestar's schema with security schemes and OpenAI's error body (the module doc).

    Args:
        schema: Litestar's OpenAPI schema as a dict (``app.openapi_schema.to_schema()``);
            left unchanged.
        app: The app whose routes it describes.

    Returns:
        A new schema dict (OpenAPI 3.1).
    """
    doc = copy.deepcopy(schema)
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    components["securitySchemes"] = SECURITY_SCHEMES
    keys = route_keys(app)
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            key = keys.get((path, method))
            responses = operation["responses"]
            had_400 = "400" in responses
            for status in [s for s in responses if s[:1] in ("4", "5") or s == "default"]:
                del responses[status]  # Litestar's own error bodies: never sent
            if had_400 or method in _BODY_METHODS:
                responses["400"] = _error(_ERRORS["400"])
            if key is not None:
                operation["security"] = [{key: []}]
                for status in ("401", "403", "429", "503"):
                    responses[status] = _error(_ERRORS[status])
            elif path == "/health":
                responses["503"] = _error("The engine is not running, or the server is stopping.")
            responses["default"] = _error(_DEFAULT)
    return doc
