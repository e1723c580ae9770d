"""OpenAI's error body on every route, for our errors and for Litestar's own.

Every error response is ``{"error": {"message", "type", "param", "code"}}`` (docs/api.md), with
the status the API documents: 400 invalid request, 401 bad key, 403 admin route with a tenant
key, 404 unknown model or adapter, 409 name taken, 413 body too large, 429 rate limited (with
``Retry-After``), 503 overloaded or engine unavailable. Litestar's default body never reaches a
client: its HTTP exceptions (validation, 404 route, 405, 413 from the body limit) are
mapped here too, and anything unexpected becomes a 500 without internals.

A database failure on any route (key lookup in the auth middleware, model resolution, usage,
admin, adapters) is not unexpected: an unreachable database (``gateway.db.errors``) answers
503 + ``Retry-After``, a value the database refuses to store or compare (a NUL character on
PostgreSQL) 400, each with one short log line (at most one a second, the rest counted), never
a traceback per request.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR
from sqlalchemy.exc import SQLAlchemyError

from loraplex.gateway.auth.redact import redact
from loraplex.gateway.db.errors import DatabaseUnavailable, describe, is_data_error, is_unreachable
from loraplex.gateway.services.errors import ConflictError, InvalidInputError, NotFoundError

logger = logging.getLogger(__name__)

# status -> OpenAI error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}

DEFAULT_CODES = {
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error fields.

    Args:
        status: HTTP status code.
        message: Shown to the client; never holds a key or internals.
        param: The request field at fault, if any.
        code: A machine-readable code (``model_not_found``, ``rate_limit_exceeded``, ...).
        headers: Extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else DEFAULT_CODES.get(status)
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> APIError:
    """A 404 (unknown model or adapter, another tenant's included)."""
    return APIError(404, message, param=param, code=code)


def rate_limited(message: str, retry_after_seconds: float) -> APIError:
    """A 429 with ``Retry-After`` in whole seconds (at least 1)."""
    seconds = max(1, math.ceil(retry_after_seconds))
    return APIError(429, message, headers={"Retry-After": str(seconds)})


def overloaded(message: str, retry_after_seconds: float) -> APIError:
    """A 503 ``overloaded`` with ``Retry-After`` in whole seconds (at least 1)."""
    seconds = max(1, math.ceil(retry_after_seconds))
    return APIError(503, message, code="overloaded", headers={"Retry-After": str(seconds)})


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body for ``status``."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """A JSON error response in OpenAI's shape."""
    return Response(
        content=error_body(status, message, param, code),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def _api_error(_: Request, exc: APIError) -> Response:
    return error_response(
        exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers
    )


def _service_error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, NotFoundError):
        return error_response(404, str(exc), code="not_found")
    if isinstance(exc, ConflictError):
        return error_response(409, str(exc), code="conflict")
    return error_response(400, str(exc))


def _http_exception(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = exc.detail or "error"
    if isinstance(exc, ValidationException):
        message = _validation_message(exc)
    elif status == 413:
        message = "request body too large"
    elif status == 404 and message == "Not Found":
        message = "no such route"
    headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "retry-after"}
    if status == 405:
        headers = dict(exc.headers or {})
    return error_response(status, message, code=DEFAULT_CODES.get(status), headers=headers)


def _validation_message(exc: ValidationException) -> str:
    extra = exc.extra
    if isinstance(extra, list) and extra:
        first = extra[0]
        if isinstance(first, dict) and first.get("message"):
            key = first.get("key")
            return f"{first['message']}" + (f" ({key})" if key else "")
    return str(exc.detail or "invalid request")


def _unexpected(request: Request, exc: Exception) -> Response:
    logger.error(
        "unhandled error on %s %s: %s",
        request.method,
        request.url.path,
        redact(repr(exc)),
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    return error_response(HTTP_500_INTERNAL_SERVER_ERROR, "internal server error")


DATABASE_RETRY_AFTER_S = 2


class _ThrottledLog:
    """One log line a second at most; the lines left out are counted in the next one."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.last = -interval
        self.suppressed = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        extra = f" ({self.suppressed} more like it since)" if self.suppressed else ""
        logger.warning(message + "%s", *args, extra)
        self.last, self.suppressed = now, 0


_database_log = _ThrottledLog()


def _database_error(request: Request, exc: Exception) -> Response:
    """503 for an unreachable database, 400 for a refused value, else the 500 handler."""
    if is_unreachable(exc):
        _database_log.warning(
            "database unavailable on %s %s: %s", request.method, request.url.path, describe(exc)
        )
        return error_response(
            503,
            "the database is unavailable; retry later",
            code="database_unavailable",
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        )
    if is_data_error(exc):
        _database_log.warning(
            "database refused a value on %s %s: %s",
            request.method,
            request.url.path,
            describe(exc),
        )
        return error_response(
            400,
            "the request holds a value that cannot be stored or looked up (e.g. a NUL character)",
            code="invalid_value",
        )
    return _unexpected(request, exc)


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    APIError: _api_error,
    SQLAlchemyError: _database_error,
    DatabaseUnavailable: _database_error,
    NotFoundError: _service_error,
    ConflictError: _service_error,
    InvalidInputError: _service_error,
    HTTPException: _http_exception,
    Exception: _unexpected,
}


def pool_busy() -> APIError:
    """429 ``too_many_pending_requests``.

    The tenant has too many jobs waiting for the input workers
    (``engine.client.fair_pool.PoolBusyError``).
    """
    return APIError(
        429,
        "too many of your requests are waiting to be processed; retry shortly",
        code="too_many_pending_requests",
        headers={"Retry-After": "1"},
    )
