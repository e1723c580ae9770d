"""The Litestar app factory: routes by domain, dependencies, auth middleware, errors, lifespan.

Handlers get the gateway's services as Litestar dependencies, by parameter name
(:func:`dependencies`): ``engine``, ``limiter``, ``admission``, ``usage``, ``sessions``,
``metrics``, ``config``, ``store``, ``key_cache``, ``secret``, ``default_limits``,
``adapter_registry``, ``in_flight``, ``draining`` and ``chat_deps`` (the hot routes' bundle
of them), each declared ``Injected[...]``
(``gateway.di``). Handlers never see the :class:`GatewayState`: only the providers here read
its attributes. The auth middleware runs before dependencies are resolved, so it is handed the
state at construction, typed as the :class:`~gateway.auth.middleware.KeyAuth` protocol (the
six things it reads), and imports nothing of ``gateway.server``.
"""

from __future__ import annotations

import asyncio
import logging

from litestar import Litestar
from litestar.config.app import AppConfig
from litestar.di import Provide
from litestar.middleware import DefineMiddleware

from loraplex.gateway.auth.middleware import KeyAuthMiddleware
from loraplex.gateway.auth.redact import RedactingFilter
from loraplex.gateway.console import console_router, template_config
from loraplex.gateway.domains import (
    adapters,
    admin,
    batches,
    chat,
    files,
    responses,
    system,
    tokenize,
    usage,
)
from loraplex.gateway.domains.chat.service import ChatDeps
from loraplex.gateway.errors import EXCEPTION_HANDLERS
from loraplex.gateway.server.docs import docs_setup
from loraplex.gateway.server.engine_watch import watch_engine
from loraplex.gateway.server.state import GatewayState
from loraplex.gateway.transport import request_id

logger = logging.getLogger(__name__)


def create_app(state: GatewayState) -> Litestar:
    """Build the gateway app around ready services.

    On startup the usage writer and the engine watchdog start, and the batches a previous run
    left unfinished resume (``gateway.domains.batches.runner``). On shutdown: the batch runner
    stops (its lines in flight are aborted; the next start resumes), new chat requests
    get 503, in-flight ones get ``shutdown_grace_seconds`` to finish (then the engine aborts
    them and their usage is recorded as aborted), usage is flushed, the database engine
    disposed, and the engine shut down if the app owns it.
    """
    state.batches = batches.BatchRunner(state.sessions, state.config, lambda: chat_deps_of(state))

    async def on_startup() -> None:
        state.usage.start()
        state.background.append(asyncio.create_task(watch_engine(state), name="engine-watch"))
        await state.batches.start()  # resume unfinished batches; sweep for expired leases

    async def on_shutdown() -> None:
        await shutdown(state)

    openapi_config, docs_routes = None, []
    if state.config.docs:  # /docs and /openapi.json, no key (gateway.server.docs)
        openapi_config, docs_routes = docs_setup(title="loraplex", version="0.1.0")
    return Litestar(
        route_handlers=[
            *docs_routes,
            *system.ROUTES,
            *chat.ROUTES,
            *responses.ROUTES,
            *tokenize.ROUTES,
            adapters.adapter_controller(state.engine, state.config),
            adapters.ModelsController,
            files.files_controller(state.config),
            batches.BatchesController,
            *usage.ROUTES,
            *admin.ROUTES,
            console_router(state),  # /console (docs/console.md)
        ],
        dependencies=dependencies(state),
        middleware=[
            DefineMiddleware(
                KeyAuthMiddleware, auth=state, exclude_from_auth_key="exclude_from_auth"
            )
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[request_id.before_send],  # x-request-id on every answer, errors included
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        request_max_body_size=state.config.chat_max_body_bytes,
        openapi_config=openapi_config,
        on_app_init=[_quiet_keys],
        template_config=template_config(),
    )


DEPENDENCIES = {
    "engine": "engine",
    "limiter": "limiter",
    "admission": "admission",
    "usage": "usage",
    "sessions": "sessions",
    "metrics": "metrics",
    "config": "config",
    "store": "store",
    "key_cache": "key_cache",
    "secret": "secret",
    "default_limits": "default_limits",
    "adapter_registry": "adapters",
    "in_flight": "in_flight",
    "draining": "draining",
    "batch_runner": "batches",
}
"""Each app-level dependency's name and the :class:`GatewayState` attribute it provides; one
more, ``chat_deps``, bundles those of the generation and tokenizer routes (``ChatDeps``)."""

DEPENDENCY_NAMES = (*DEPENDENCIES, "chat_deps")


def dependencies(state: GatewayState) -> dict[str, Provide]:
    """The app-level dependencies: each of ``state``'s services under the name handlers use.

    Each is read from ``state`` when a request asks for it (an attribute read): ``draining``
    changes at shutdown, and a service replaced on the state (a test's failing database) is
    what the next request gets.
    """

    def provide(attribute: str) -> Provide:
        def dependency() -> object:
            return getattr(state, attribute)

        return Provide(dependency, sync_to_thread=False)

    def chat_deps() -> ChatDeps:
        return chat_deps_of(state)

    provided = {name: provide(attribute) for name, attribute in DEPENDENCIES.items()}
    provided["chat_deps"] = Provide(chat_deps, sync_to_thread=False)
    return provided


def chat_deps_of(state: GatewayState) -> ChatDeps:
    """The generation routes' dependencies (``ChatDeps``) as ``state`` holds them now."""
    return ChatDeps(
        config=state.config,
        engine=state.engine,
        sessions=state.sessions,
        limiter=state.limiter,
        admission=state.admission,
        usage=state.usage,
        metrics=state.metrics,
        default_limits=state.default_limits,
        in_flight=state.in_flight,
        draining=state.draining,
    )


def _quiet_keys(config: AppConfig) -> AppConfig:
    """Make sure no log record of ours or the server's carries a key."""
    for name in ("", "litestar", "uvicorn", "uvicorn.access", "uvicorn.error"):
        target = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())
    return config


async def shutdown(state: GatewayState) -> None:
    """Drain, flush usage, release the database and (if owned) the engine."""
    state.draining = True
    for task in state.background:
        task.cancel()
    if state.batches is not None:  # their lines are aborted; the next start resumes them
        await state.batches.close()
    if state.in_flight:
        _, pending = await asyncio.wait(
            set(state.in_flight), timeout=state.config.shutdown_grace_seconds
        )
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)
    if state.owns_engine:
        await asyncio.to_thread(state.engine.shutdown)
    await state.usage.close()
    await state.limiter.close()
    await state.db.dispose()
