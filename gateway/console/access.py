"""Who may see and change what in the console: login, the session cookie, CSRF, tenant scope.

Every console route is excluded from the API's bearer-key middleware and checked here instead,
on the server, for every page, fragment and change:

* **Login** (``POST /console/login``) takes the admin key or a tenant key and resolves it with
  the API's own check (``gateway.auth.middleware.resolve_key``: constant-time admin compare,
  HMAC lookup and the key cache). A wrong key counts in the same per-address failed-auth
  throttle as the API's 401s (``gateway.limits.auth_throttle``), so guessing keys through the
  console is no faster than through ``/v1``.
* **Session**: the cookie ``lpx_console`` holds a random session id only
  (:mod:`gateway.console.sessions`), ``HttpOnly``, ``SameSite=Strict``, ``Path=/console``, and
  ``Secure`` when the request came over TLS (``https``, or a trusted proxy's
  ``X-Forwarded-Proto``). A tenant session's key is checked again on every request (revoked:
  the session ends).
* **CSRF**: every change (``POST``) needs the header ``X-CSRF-Token`` equal to the session's
  synchronizer token (OWASP's "synchronizer token pattern"), and an ``Origin`` header, when the
  browser sends one, equal to the console's own origin. A form another site posts can set
  neither; ``SameSite=Strict`` keeps the cookie off it anyway.
* **Scope**: a tenant session sees its own tenant only: a URL naming another tenant
  (``?tenant=``) is refused with 403, another tenant's key or adapter is a 404 like one that
  does not exist. The admin sees every tenant.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Request
from litestar.datastructures import Cookie
from sqlalchemy.ext.asyncio import async_sessionmaker

from loraplex.gateway.auth.middleware import KeyAuth, resolve_key
from loraplex.gateway.auth.principals import AdminPrincipal
from loraplex.gateway.console.sessions import ConsoleSession, ConsoleSessions
from loraplex.gateway.services.errors import NotFoundError
from loraplex.gateway.services.keys import get_key

COOKIE = "lpx_console"
CSRF_HEADER = "x-csrf-token"
MAX_KEY_FIELD = 512  # characters of the login form's key field (a key is 47; the admin's ~50)


class ConsoleError(Exception):
    """A refusal the console shows as a page (or, for htmx, a fragment) with ``status``.

    Args:
        status: The HTTP status (401, 403, 404, 400, 413, 429).
        message: What the person reads.
        headers: Extra response headers (``Retry-After``, ``HX-Redirect``).
    """

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def session_cookie(request: Request, value: str, *, expire: bool = False) -> Cookie:
    """The ``lpx_console`` cookie carrying ``value`` (``expire``: the one that deletes it)."""
    return Cookie(
        key=COOKIE,
        value=value,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        max_age=0 if expire else None,
    )


def same_origin(request: Request) -> bool:
    """Whether the request comes from the console's own site.

    False when the browser's ``Sec-Fetch-Site`` says ``cross-site`` (Fetch Metadata), or its
    ``Origin`` (when sent) is another origin's.
    """
    if request.headers.get("sec-fetch-site", "").lower() == "cross-site":
        return False  # the browser says so, whether or not it sent an Origin
    origin = request.headers.get("origin")
    if origin is None:
        return True
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    return hmac.compare_digest(origin.lower().encode(), own.lower().encode())


def check_csrf(request: Request, session: ConsoleSession) -> None:
    """Refuse a change without the session's CSRF token or from another origin.

    Raises:
        ConsoleError: 403.
    """
    token = request.headers.get(CSRF_HEADER, "")
    if not same_origin(request):
        raise ConsoleError(403, "refused: the request came from another site (Origin)")
    if not token or not hmac.compare_digest(token.encode(), session.csrf.encode()):
        raise ConsoleError(403, "refused: missing or wrong CSRF token; reload the page")


async def current_session(
    request: Request, sessions: async_sessionmaker, console_sessions: ConsoleSessions
) -> ConsoleSession:
    """The request's live session, its tenant key checked again; CSRF checked for a change.

    Raises:
        ConsoleError: 401 (with ``HX-Redirect`` to the login page) without a live session or
            when its tenant key was revoked; 403 for a change failing :func:`check_csrf`.
    """
    session = console_sessions.get(request.cookies.get(COOKIE))
    if session is not None and session.key_id is not None:
        async with sessions() as db:
            try:
                key = await get_key(db, session.key_id)
            except NotFoundError:
                key = None
        if key is None or key.revoked_at is not None:
            console_sessions.end(session.id)
            session = None
    if session is None:
        raise ConsoleError(
            401, "log in to the console first", headers={"HX-Redirect": "/console/login"}
        )
    if request.method not in ("GET", "HEAD"):
        check_csrf(request, session)
    return session


def scope_tenant(session: ConsoleSession, requested: str | None) -> str | None:
    """The tenant a request may look at: a tenant session's own, or the admin's choice.

    Args:
        session: The request's session.
        requested: The ``?tenant=`` it names (None or ``""``: the session's default).

    Returns:
        The tenant id to filter on; None means every tenant (the admin only).

    Raises:
        ConsoleError: 403 when a tenant session names another tenant.
    """
    requested = requested or None
    if session.admin:
        return requested
    if requested is not None and requested != session.tenant_id:
        raise ConsoleError(403, "refused: a tenant key sees its own tenant only")
    return session.tenant_id


async def login(auth: KeyAuth, console_sessions: ConsoleSessions, key: Any) -> ConsoleSession:
    """Start a session for ``key`` (the admin key or a live tenant key).

    Raises:
        ConsoleError: 400 for a missing or oversized key field; 401 for a wrong key.
    """
    if not isinstance(key, str) or not key.strip():
        raise ConsoleError(400, "enter an API key")
    if len(key) > MAX_KEY_FIELD:
        raise ConsoleError(400, f"the key field is over {MAX_KEY_FIELD} characters")
    principal = await resolve_key(auth, key.strip())
    if principal is None:
        raise ConsoleError(401, "invalid API key (unknown or revoked)")
    if isinstance(principal, AdminPrincipal):
        return console_sessions.start(admin=True)
    return console_sessions.start(
        admin=False,
        tenant_id=principal.tenant_id,
        tenant_name=principal.tenant_name,
        key_id=principal.key_id,
    )
