"""Each request's ``X-Request-Id``: the client's own if it is valid, else one made here.

Every response carries ``x-request-id`` (issue 31): answers of the app, on every route and
status (``gateway.server.app`` adds it in a ``before_send`` hook, so errors raised before
routing, in the auth middleware or in a handler carry it too), of the metrics listener, and
the transport's own refusals (408, 431, 503, a 400 for a request that does not parse). The
access log shows the same id (``request_id=...``).

The id is the client's ``X-Request-Id`` when it is **valid**: 1 to 64 printable ASCII
characters with no space (``0x21``-``0x7e``; the usage row's ``client_request_id`` column holds
64), the first such header of the request. Anything else (too long, a space, a control or
non-ASCII byte, empty) is never echoed: the response gets a generated id instead, so no header
or log line can be forged through it. A generated id is 32 lowercase hex digits, a UUID4 as vLLM
makes one (``uuid.uuid4().hex``; vLLM's ``--enable-request-id-headers`` echoes the client's
header as it is, or that). The chat and completions routes, which bill the request, refuse an
invalid ``X-Request-Id`` with a 400 naming it (``docs/usage.md``), and the server's id of the
executed request (the response ``id``, the usage row's ``request_id``) ends with the
generated id when the client sent none, so the access line, the response and the usage row
name one request.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import MutableMapping
from typing import Any

HEADER = "x-request-id"
HEADER_BYTES = b"x-request-id"
SCOPE_KEY = "loraplex.request_id"  # the request's id, once made, in its ASGI scope
VALID = re.compile(rb"[\x21-\x7e]{1,64}")
"""A valid client id: 1 to 64 printable ASCII characters, no space (``fullmatch``)."""


def new_id() -> str:
    """A fresh id: a UUID4's 32 lowercase hex digits (vLLM's ``uuid.uuid4().hex``)."""
    return uuid.uuid4().hex


def client_id(scope: MutableMapping[str, Any]) -> str | None:
    """The client's ``X-Request-Id`` if it sent a valid one (see the module doc), else None.

    Args:
        scope: An ASGI ``http`` scope (``headers``: lowercase names, as ASGI servers give).

    Returns:
        The first ``X-Request-Id`` header's value when it is valid; None when there is none
        or the first one is not.
    """
    for name, value in scope.get("headers") or ():
        if name == HEADER_BYTES:
            return value.decode("ascii") if VALID.fullmatch(value) else None
    return None


def sent_id(scope: MutableMapping[str, Any]) -> bytes | None:
    """The raw value of the request's first ``X-Request-Id`` header, valid or not (None: none)."""
    for name, value in scope.get("headers") or ():
        if name == HEADER_BYTES:
            return value
    return None


def request_id(scope: MutableMapping[str, Any]) -> str:
    """The request's id: the client's valid ``X-Request-Id``, else a generated one.

    Made once per request and kept in the scope (``SCOPE_KEY``), so the response header, the
    access line and the handler see the same id.

    Args:
        scope: The request's ASGI ``http`` scope.

    Returns:
        The id (1 to 64 printable ASCII characters, no space).
    """
    rid = scope.get(SCOPE_KEY)
    if rid is None:
        rid = client_id(scope) or new_id()
        scope[SCOPE_KEY] = rid
    return rid


def tag_response(message: MutableMapping[str, Any], scope: MutableMapping[str, Any]) -> None:
    """Add ``x-request-id`` to an ASGI ``http.response.start`` message (others: unchanged).

    A response that already names one keeps it.

    Args:
        message: An ASGI message about to be sent.
        scope: Its request's scope.
    """
    if message["type"] != "http.response.start":
        return
    headers = list(message.get("headers") or ())  # a copy: the app's own list is left alone
    for name, _ in headers:
        if name.lower() == HEADER_BYTES:
            return
    headers.append((HEADER_BYTES, request_id(scope).encode("ascii")))
    message["headers"] = headers


async def before_send(message: MutableMapping[str, Any], scope: MutableMapping[str, Any]) -> None:
    """Litestar's ``before_send`` hook form of :func:`tag_response` (every message of the app)."""
    if scope.get("type") == "http":
        tag_response(message, scope)
