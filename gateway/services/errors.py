"""Errors the services raise; the HTTP layer maps them to status codes."""

from __future__ import annotations


class ServiceError(Exception):
    """Base class for domain errors with a message fit to show the caller."""


class NotFoundError(ServiceError, LookupError):
    """The tenant, key or adapter does not exist (or is not the caller's): HTTP 404."""


class ConflictError(ServiceError):
    """The name is taken: HTTP 409."""


class InvalidInputError(ServiceError, ValueError):
    """A value the service refuses (empty name, negative limit): HTTP 400."""
