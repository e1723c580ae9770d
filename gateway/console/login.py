"""``/console``, ``/console/login`` and ``/console/logout`` (see ``gateway.console.access``)."""

from __future__ import annotations

import math

from litestar import Request, Response, get, post
from litestar.response import Redirect

from loraplex.gateway.auth.middleware import KeyAuth
from loraplex.gateway.console.access import (
    COOKIE,
    ConsoleError,
    login,
    same_origin,
    session_cookie,
)
from loraplex.gateway.console.sessions import ConsoleSession, ConsoleSessions
from loraplex.gateway.console.views import SECURITY_HEADERS, page
from loraplex.gateway.di import Injected
from loraplex.gateway.limits.auth_throttle import client_group

CONSOLE = {"exclude_from_auth": True}  # the console checks its own session (console.access)


@get("/", opt=CONSOLE, sync_to_thread=False)
def home(request: Request, console_sessions: Injected[ConsoleSessions]) -> Redirect:
    """To the usage page when logged in, else to the login page."""
    live = console_sessions.get(request.cookies.get(COOKIE))
    return Redirect("/console/usage" if live else "/console/login", status_code=303)


@get("/login", opt=CONSOLE, sync_to_thread=False)
def login_page() -> Response:
    """The login form: one password field for an API key."""
    return page("login.html", None)


@post("/login", opt=CONSOLE)
async def login_submit(
    request: Request, console_auth: Injected[KeyAuth], console_sessions: Injected[ConsoleSessions]
) -> Response:
    """Form ``key`` -> 303 to the usage page with the session cookie, or the form again.

    Raises:
        ConsoleError: 403 from another origin; 429 with ``Retry-After`` while this address is
            throttled for failed keys (the API's throttle); 400 or 401 from :func:`login`
            (a 401 counts as a failure of this address).
    """
    if not same_origin(request):
        raise ConsoleError(403, "refused: the login came from another site (Origin)")
    throttle = console_auth.auth_throttle
    client = client_group(request.scope.get("client"))
    wait = throttle.retry_after(client)
    if wait is not None:
        seconds = max(1, math.ceil(wait))
        raise ConsoleError(
            429,
            f"too many failed logins from this address; retry after {seconds} s",
            headers={"Retry-After": str(seconds)},
        )
    form = await request.form()
    try:
        session = await login(console_auth, console_sessions, form.get("key"))
    except ConsoleError as exc:
        if exc.status == 401:
            throttle.failed(client)
        return page("login.html", None, status_code=exc.status, error=exc.message)
    response = Redirect("/console/usage", status_code=303, headers=SECURITY_HEADERS)
    response.set_cookie(session_cookie(request, session.id))
    return response


@post("/logout", opt=CONSOLE)
async def logout(
    request: Request, console: Injected[ConsoleSession], console_sessions: Injected[ConsoleSessions]
) -> Response | Redirect:
    """End the session (CSRF-checked like every change) and clear the cookie."""
    console_sessions.end(console.id)
    response: Response
    if request.headers.get("hx-request") == "true":  # htmx follows HX-Redirect itself
        response = Response("", status_code=200, headers={"HX-Redirect": "/console/login"})
    else:
        response = Redirect("/console/login", status_code=303)
    response.set_cookie(session_cookie(request, "", expire=True))
    return response
