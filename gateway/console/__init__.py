"""The web console at ``/console`` (docs/console.md): usage, keys, adapters, the live engine.

Server-rendered Jinja pages with htmx for the live parts and uPlot for the plots, both shipped
in ``gateway/console/static`` with their licences (no CDN: the console works offline). Login,
sessions, CSRF and tenant scope: :mod:`gateway.console.access`.
"""

from __future__ import annotations

from litestar import Request, Router
from litestar.di import Provide
from litestar.static_files import create_static_files_router

from loraplex.gateway.console import engine_page, keys_page, login, usage_page
from loraplex.gateway.console.access import current_session
from loraplex.gateway.console.adapters_page import adapters_controller
from loraplex.gateway.console.sessions import ConsoleSession, ConsoleSessions
from loraplex.gateway.console.views import EXCEPTION_HANDLERS, STATIC, template_config

__all__ = ["console_router", "template_config"]


def console_router(state, sessions: ConsoleSessions | None = None) -> Router:
    """The ``/console`` routes for the app around ``state`` (a ``GatewayState``).

    Args:
        state: The app's state: its engine, config, database sessions and, for the login,
            the keys, key cache and failed-auth throttle (``gateway.auth.middleware.KeyAuth``).
        sessions: The console's session store (tests pass one with a fake clock); default a
            new in-memory one.
    """
    store = sessions if sessions is not None else ConsoleSessions()

    def console_sessions() -> ConsoleSessions:
        return store

    def console_auth():
        return state

    async def console(request: Request) -> ConsoleSession:
        return await current_session(request, state.sessions, store)

    static = create_static_files_router(
        "/static", directories=[STATIC], opt={"exclude_from_auth": True}, name="console-static"
    )
    return Router(
        "/console",
        route_handlers=[
            login.home,
            login.login_page,
            login.login_submit,
            login.logout,
            usage_page.usage_page,
            usage_page.usage_csv,
            keys_page.keys_page,
            keys_page.create_tenant,
            keys_page.new_key,
            keys_page.revoke,
            adapters_controller(state.engine, state.config),
            engine_page.engine_page,
            engine_page.engine_live,
            static,
        ],
        dependencies={
            "console": Provide(console),
            "console_sessions": Provide(console_sessions, sync_to_thread=False),
            "console_auth": Provide(console_auth, sync_to_thread=False),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        opt={"exclude_from_auth": True},
        include_in_schema=False,
    )
