"""Everything the routes share, built once per app.

Handlers never see this object: :func:`gateway.server.app.create_app`'s dependency providers
read its attributes for each request and hand the handlers the parts they name, and the auth
middleware is given it at construction as a ``gateway.auth.middleware.KeyAuth``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from loraplex.adapters.object_store import ObjectAdapterStore, open_store
from loraplex.adapters.store import AdapterStore
from loraplex.gateway.auth.key_cache import KeyCache
from loraplex.gateway.domains.adapters.service import Registry
from loraplex.gateway.limits.admission import AdmissionControl
from loraplex.gateway.limits.auth_throttle import AuthThrottle
from loraplex.gateway.limits.ratelimit import RateLimiter
from loraplex.gateway.limits.ratelimit_shared import SharedRateLimiter
from loraplex.gateway.metrics.registry import GatewayMetrics
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.server.engine_client import EngineClient
from loraplex.gateway.services.tenants import TenantLimits
from loraplex.gateway.usage.spool import UsageSpool
from loraplex.gateway.usage.writer import UsageWriter


@dataclass
class GatewayState:
    """Shared services of one gateway app.

    Attributes:
        config: Gateway settings.
        engine: The engine behind the API.
        db: The database engine (disposed on shutdown).
        sessions: Async session factory.
        secret: Server secret for key HMACs.
        admin_key: The admin key (never logged).
        store: The content-addressed adapter store.
        key_cache: Verified keys.
        limiter: Per-key rate limits.
        usage: The usage writer (spool, then database).
        metrics: Prometheus registry and counters.
        admission: Global bounds on outstanding requests and tokens.
        auth_throttle: Failed authentications per client address.
        adapters: Adapter changes' lock, pending removals and upload slots.
        owns_engine: Shut the engine down with the app (False when tests share one).
        draining: Set on shutdown: new chat requests get 503.
        in_flight: Chat requests running now (graceful shutdown waits for them).
        on_engine_death: Called once if the engine stops while serving
            (``gateway.server.engine_watch``); ``loraplex serve`` exits non-zero from it.
        background: The app's own background tasks (cancelled on shutdown).
        batches: The batch runner (``gateway.domains.batches.runner``), set by the app.
    """

    config: GatewayConfig
    engine: EngineClient
    db: AsyncEngine
    sessions: async_sessionmaker
    secret: bytes
    admin_key: str
    store: AdapterStore | ObjectAdapterStore
    key_cache: KeyCache
    limiter: RateLimiter | SharedRateLimiter
    usage: UsageWriter
    metrics: GatewayMetrics
    admission: AdmissionControl
    auth_throttle: AuthThrottle
    adapters: Registry = field(default_factory=Registry)
    owns_engine: bool = True
    draining: bool = False
    in_flight: set[asyncio.Task] = field(default_factory=set)
    on_engine_death: Callable[[], None] | None = None
    background: list[asyncio.Task] = field(default_factory=list)
    batches: Any = None

    @property
    def default_limits(self) -> TenantLimits:
        """The server-wide limits (flags) for tenants that set none."""
        c = self.config
        return TenantLimits(
            requests_per_minute=c.default_requests_per_minute,
            tokens_per_minute=c.default_tokens_per_minute,
            max_concurrent_requests=c.default_max_concurrent_requests,
        )


def build_state(
    config: GatewayConfig,
    engine: EngineClient,
    *,
    admin_key: str,
    owns_engine: bool = True,
) -> GatewayState:
    """Wire the shared services for ``config`` (no I/O beyond creating the data directory).

    The database must already be migrated (``gateway.db.migrate.upgrade``).
    """
    from loraplex.gateway.auth.secrets_store import load_or_create_secret
    from loraplex.gateway.db.session import make_engine, session_factory
    from loraplex.gateway.settings import private_dir

    private_dir(config.data_dir)
    db = make_engine(config.db_url)
    sessions = session_factory(db)
    limiter = make_limiter(config.rate_limit_url)
    metrics = GatewayMetrics(engine.stats, engine.model_name, config.metrics_max_adapter_labels)
    metrics.watch_limiter(limiter)
    return GatewayState(
        config=config,
        engine=engine,
        db=db,
        sessions=sessions,
        secret=load_or_create_secret(config.data_dir),
        admin_key=admin_key,
        store=open_store(config.store_location),
        key_cache=KeyCache(
            config.auth_cache_seconds, stale_if_error=config.auth_stale_if_error_seconds
        ),
        limiter=limiter,
        usage=UsageWriter(
            sessions,
            spool=UsageSpool(config.spool_dir, fsync=config.usage_spool_fsync),
            dead_letter=config.dead_letter_path,
            flush_seconds=config.usage_flush_seconds,
            backlog_limit=config.usage_backlog_limit,
        ),
        metrics=metrics,
        admission=AdmissionControl(
            config.max_outstanding_requests, config.max_outstanding_tokens, config.tenant_share
        ),
        auth_throttle=AuthThrottle(
            config.auth_max_failures,
            config.auth_failure_window_seconds,
            config.auth_throttle_max_clients,
        ),
        adapters=Registry(uploads=asyncio.Semaphore(config.max_concurrent_uploads)),
        owns_engine=owns_engine,
    )


def make_limiter(url: str | None) -> RateLimiter | SharedRateLimiter:
    """The per-key rate limiter: in this process, or shared in the Redis at ``url``.

    Raises:
        ValueError: an invalid Redis URL, or redis-py missing (the ``redis`` extra).
    """
    return RateLimiter() if url is None else SharedRateLimiter(url)
