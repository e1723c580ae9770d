"""Assemble a running gateway: migrated database, engine with the adapter store, the app.

``loraplex serve`` and the live-server tests both go through :func:`build_gateway`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from litestar import Litestar

from loraplex.engine.config import EngineConfig
from loraplex.gateway.server.app import create_app
from loraplex.gateway.server.config import GatewayConfig
from loraplex.gateway.server.engine_client import EngineClient, LocalEngineClient
from loraplex.gateway.server.state import GatewayState, build_state


def served_name(engine_config: EngineConfig) -> str:
    """``--served-model-name``, else the model directory's base name."""
    return engine_config.served_model_name or Path(engine_config.model).name


def start_engine(
    engine_config: EngineConfig,
    store_root: Path,
    *,
    in_process: bool = True,
    replicas: int = 1,
    ray_address: str | None = None,
) -> EngineClient:
    """Load the model and start the engine, reading tenant adapters from the store.

    Args:
        engine_config: The engine's settings.
        store_root: The adapter store.
        in_process: The engine core on a thread of this process (``LLM``, tests); else in its
            own process (``serve``'s default: ``gateway.server.process_client``).
        replicas: Engine cores behind one router (``gateway.routing``); more than 1 records
            KV events in every core, and on a CPU splits the automatic KV share between them.
        ray_address: Place the cores as Ray actors on this cluster (``"auto"``, an address,
            or ``"local"`` for a new local instance) instead of child processes.

    Raises:
        ValueError: the model or config is unusable (in process), or ``replicas < 1``.
        RuntimeError: a core process exited before it was ready (its error is logged).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if replicas > 1 or ray_address is not None:
        return _start_replicas(engine_config, store_root, in_process, replicas, ray_address)
    if not in_process:
        from loraplex.gateway.server.process_client import ProcessEngineClient

        return ProcessEngineClient(engine_config, str(store_root), served_name(engine_config))
    from loraplex.adapters.store import AdapterStore
    from loraplex.engine.async_llm import AsyncLLM
    from loraplex.engine.llm_engine import LLMEngine

    store = AdapterStore(store_root)
    holder: dict[str, Any] = {}

    def load(digest: str) -> Any:
        limits = holder["client"].adapter_limits
        return store.load(
            digest,
            target_shapes=limits.target_shapes,
            num_layers=limits.num_layers,
            max_rank=limits.max_rank,
        )

    engine = LLMEngine(engine_config, adapter_loader=load)
    client = LocalEngineClient(AsyncLLM(engine=engine), served_name(engine_config))
    holder["client"] = client
    return client


def _start_replicas(
    engine_config: EngineConfig,
    store_root: Path,
    in_process: bool,
    replicas: int,
    ray_address: str | None,
) -> EngineClient:
    """``replicas`` cores (child processes, Ray actors, or in process) behind a router."""
    from loraplex.gateway.routing import ReplicaSetClient, RoutingPolicy

    config = engine_config.replace(enable_kv_events=True)
    if config.device == "cpu" and ray_address is None:  # one machine's memory and cores
        config = config.replace(
            cpu_kv_cache_share=config.cpu_kv_cache_share / replicas,
            num_cpu_threads=config.num_cpu_threads or max(1, (os.cpu_count() or 1) // replicas),
        )
    launcher = None
    if ray_address is not None:
        from loraplex.engine.core_launch import RayLauncher

        launcher = RayLauncher(ray_address, num_gpus=1 if config.device == "cuda" else 0)
    clients: dict[str, EngineClient] = {}
    try:
        for i in range(replicas):
            if launcher is None and in_process:
                clients[f"replica-{i}"] = start_engine(config, store_root)
            else:
                from loraplex.gateway.server.process_client import ProcessEngineClient

                clients[f"replica-{i}"] = ProcessEngineClient(
                    config, str(store_root), served_name(config), launcher=launcher
                )
    except BaseException:
        for client in clients.values():
            client.shutdown()
        raise
    return ReplicaSetClient(
        clients, RoutingPolicy(block_size=config.block_size), prefix_hash=config.prefix_hash
    )


def build_gateway(
    gateway_config: GatewayConfig,
    engine: EngineClient,
    *,
    admin_key: str,
    owns_engine: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[Litestar, GatewayState]:
    """Migrate the database, collect orphaned adapter weights, build the app around ``engine``.

    Args:
        gateway_config: The gateway's settings.
        engine: The engine client the app serves.
        admin_key: The admin API's key.
        owns_engine: The app's shutdown stops the engine.
        progress: Called with a line for people once the database is migrated (``serve``).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database is unreachable or cannot be migrated.
    """
    from loraplex.gateway.db.migrate import upgrade
    from loraplex.gateway.domains.adapters.orphans import collect_orphans_at_start
    from loraplex.gateway.settings import private_dir

    private_dir(gateway_config.data_dir)
    t0 = time.monotonic()
    upgrade(gateway_config.db_url)
    if progress is not None:
        from sqlalchemy.engine import make_url

        from loraplex.gateway.db.migrate import head_revision

        safe = make_url(gateway_config.db_url).render_as_string(hide_password=True)
        progress(
            f"database migrated to revision {head_revision()} in "
            f"{time.monotonic() - t0:.1f} s ({safe})"
        )
    state = build_state(gateway_config, engine, admin_key=admin_key, owns_engine=owns_engine)
    collect_orphans_at_start(gateway_config.db_url, state.store)
    return create_app(state), state
