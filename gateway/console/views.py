"""Rendering the console's pages: templates, security headers, and refusals as pages.

Pages are Jinja templates (``gateway/console/templates``) rendered by Litestar's template
support (``TemplateConfig`` with ``JinjaTemplateEngine``, autoescaping on). Every answer carries a
``Content-Security-Policy`` that lets the page run only the gateway's own scripts and styles
(no inline script, no other origin, no framing) and ``Cache-Control: no-store`` (a page shows a
tenant's data; a new key is shown once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request, Response
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.template.config import TemplateConfig

from loraplex.gateway.console.access import ConsoleError
from loraplex.gateway.console.sessions import ConsoleSession
from loraplex.gateway.errors import APIError
from loraplex.gateway.services.errors import ConflictError, InvalidInputError, NotFoundError

HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def template_config() -> TemplateConfig:
    """The app's template support: the console's templates through Jinja (autoescaped)."""
    return TemplateConfig(directory=TEMPLATES, engine=JinjaTemplateEngine)


def page(
    name: str,
    session: ConsoleSession | None,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> Template:
    """Render template ``name`` with the session (nav, CSRF token) and ``context``."""
    return Template(
        template_name=name,
        context={"session": session, **context},
        status_code=status_code,
        headers={**SECURITY_HEADERS, **(headers or {})},
    )


def _refusal(request: Request, status: int, message: str, headers: dict[str, str]) -> Response:
    if status == 401 and request.method == "GET" and request.headers.get("hx-request") != "true":
        return Redirect("/console/login", status_code=303, headers=SECURITY_HEADERS)
    if request.headers.get("hx-request") == "true":  # an htmx change: into the page's flash box
        headers = {"HX-Retarget": "#flash", "HX-Reswap": "innerHTML", **headers}
        return page("_flash.html", None, status_code=status, headers=headers, message=message)
    return page("error.html", None, status_code=status, headers=headers, message=message)


def console_error(request: Request, exc: Exception) -> Response:
    """The console's exception handler: a refusal as a page (or an htmx flash), never JSON.

    A page asked for without a live session redirects to the login page (303).

    ``ConsoleError`` and ``APIError`` keep their status and message; the services'
    ``NotFoundError`` is a 404, ``ConflictError`` a 409, ``InvalidInputError`` a 400.
    """
    if isinstance(exc, ConsoleError | APIError):
        return _refusal(request, exc.status, exc.message, dict(exc.headers))
    status = {NotFoundError: 404, ConflictError: 409, InvalidInputError: 400}[type(exc)]
    return _refusal(request, status, str(exc), {})


EXCEPTION_HANDLERS = {
    ConsoleError: console_error,
    APIError: console_error,
    NotFoundError: console_error,
    ConflictError: console_error,
    InvalidInputError: console_error,
}
