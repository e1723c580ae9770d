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
from loraplex.gateway.server.engine_client import EngineClient
from loraplex.gateway.server.state import GatewayState, build_state


def served_name(engine_config: EngineConfig) -> str:
    """``--served-model-name``, else the one resolution set, else the directory's base name."""
    return engine_config.served_model_name or Path(engine_config.model).name


def start_engine(
    engine_config: EngineConfig,
    store_root: str | Path,
    *,
    in_process: bool = True,
    replicas: int = 1,
    ray_address: str | None = None,
    quarantine: Any = None,
) -> EngineClient:
    """Load the model and start the engine, reading tenant adapters from the store.

    The model source is resolved first, once (``engine.models.source.resolve_model_source``:
    a Hub id fetched, a GGUF file converted); every core (a thread, child processes, Ray actors)
    and the front get the resolved config, so none downloads or converts it again.

    Args:
        engine_config: The engine's settings.
        store_root: The adapter store.
        in_process: The engine core on a thread of this process (``LLM``, tests); else in its
            own process (``serve``'s default: ``engine.client.process``).
        replicas: Engine cores behind one router (``engine.client.replicas``); more than 1 records
            KV events in every core, and on a CPU splits the automatic KV share between them.
        ray_address: Place the cores as Ray actors on this cluster (``"auto"``, an address,
            or ``"local"`` for a new local instance) instead of child processes.
        quarantine: Core deaths and quarantined requests (``engine.client.quarantine.Quarantine``),
            one for every replica; ``serve`` keeps it in the data directory. None: a new one in
            memory. An engine in this process has none: a native fault ends the process.

    Raises:
        ValueError: a model source that names nothing loadable (``ModelSourceError``), the
            model or config is unusable (in process), or ``replicas < 1``.
        RuntimeError: a core process exited before it was ready (its error is logged).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    from loraplex.engine.client.front import AsyncLLM
    from loraplex.engine.models.source import resolve_model_source

    engine_config = resolve_model_source(engine_config)

    cores = start_cores(
        engine_config,
        store_root,
        in_process=in_process,
        replicas=replicas,
        ray_address=ray_address,
        quarantine=quarantine,
    )
    try:
        front = AsyncLLM(cores, engine_config, model_name=served_name(engine_config))
    except BaseException:
        cores.shutdown()
        raise
    from loraplex.engine.client.inproc import InprocCoreClient

    if isinstance(cores, InprocCoreClient):  # one process: its grammars use the front's tokenizer
        cores.engine_core.structured.use_tokenizer(front.tokenizer)
    return front


def start_cores(
    engine_config: EngineConfig,
    store_root: str | Path,
    *,
    in_process: bool = True,
    replicas: int = 1,
    ray_address: str | None = None,
    quarantine: Any = None,
) -> Any:
    """The core client the front talks to (see :func:`start_engine` for the arguments).

    One core on a thread (``engine.client.inproc``), in a child process
    (``engine.client.process``), or ``replicas`` of them (child processes, Ray actors, or in
    process) behind a router (``engine.client.replicas``).

    Raises:
        ValueError, RuntimeError: as :func:`start_engine`.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    from loraplex.engine.core.cpu_bind import check_bind

    check_bind(
        engine_config.cpu_threads_bind,
        replicas,
        in_process=in_process and ray_address is None,
        remote=ray_address is not None,
    )
    if replicas > 1 or ray_address is not None:
        return _start_replicas(
            engine_config, store_root, in_process, replicas, ray_address, quarantine
        )
    if not in_process:
        from loraplex.engine.client.process import ProcessCoreClient

        core = ProcessCoreClient(engine_config, str(store_root), quarantine=quarantine)
        core.start()
        return core
    from loraplex.adapters.object_store import open_store
    from loraplex.engine.client.inproc import InprocCoreClient
    from loraplex.engine.core.engine_core import EngineCore

    store = open_store(store_root)
    holder: dict[str, Any] = {}

    def load(digest: str) -> Any:
        return store.load(digest, limits=holder["core"].adapter_limits)

    holder["core"] = EngineCore(engine_config, adapter_loader=load)
    return InprocCoreClient(holder["core"])


def _start_replicas(
    engine_config: EngineConfig,
    store_root: str | Path,
    in_process: bool,
    replicas: int,
    ray_address: str | None,
    quarantine: Any = None,
) -> Any:
    """``replicas`` cores (child processes, Ray actors, or in process) behind a router."""
    from loraplex.engine.client.quarantine import Quarantine
    from loraplex.engine.client.replicas import ReplicaRouter
    from loraplex.engine.client.router import RoutingPolicy

    quarantine = quarantine if quarantine is not None else Quarantine()  # one for all

    from loraplex.engine.core.cpu_bind import NOBIND, engine_config_for

    config = engine_config.replace(enable_kv_events=True)
    if config.device == "cpu" and ray_address is None:  # one machine's memory
        config = config.replace(cpu_kv_cache_share=config.cpu_kv_cache_share / replicas)
    if ray_address is not None or in_process:  # nothing to bind (check_bind refused lists)
        config = config.replace(cpu_threads_bind=NOBIND)
    from loraplex.engine.core.launch import ProcessLauncher, RayLauncher

    if config.device == "cuda" and ray_address is None and not in_process:
        per_gpu = -(-replicas // max(1, len(_visible_gpus())))  # replicas sharing one GPU
        config = config.replace(gpu_memory_utilization=config.gpu_memory_utilization / per_gpu)
    ray = None
    if ray_address is not None:
        ray = RayLauncher(ray_address, num_gpus=1 if config.device == "cuda" else 0)
    cores: dict[str, Any] = {}
    try:
        for i in range(replicas):
            # This machine's cores split between the replicas (their own CPUs with auto or
            # lists, else a share of threads each); Ray places each actor where it has room.
            replica = config if ray is not None else engine_config_for(config, replicas, i)
            if ray is None and in_process:
                cores[f"replica-{i}"] = start_cores(replica, store_root)
                continue
            from loraplex.engine.client.process import ProcessCoreClient

            launcher = ray or ProcessLauncher(_replica_env(replica, i))
            core = ProcessCoreClient(
                replica, str(store_root), launcher=launcher, quarantine=quarantine
            )
            core.start()
            cores[f"replica-{i}"] = core
    except BaseException:
        for core in cores.values():
            core.shutdown()
        raise
    return ReplicaRouter(cores, RoutingPolicy(block_size=config.block_size))


def _visible_gpus() -> list[str]:
    """The CUDA devices this process may use (``CUDA_VISIBLE_DEVICES``, else all)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _replica_env(config: EngineConfig, index: int) -> dict[str, str]:
    """A child-process replica's environment: on CUDA, one of the visible GPUs.

    Round robin over the visible GPUs; replicas sharing one split ``gpu_memory_utilization``.

    Raises:
        ValueError: ``--device cuda`` and no visible GPU.
    """
    if config.device != "cuda":
        return {}
    devices = _visible_gpus()
    if not devices:
        raise ValueError("--device cuda with replicas, but no CUDA device is visible")
    return {"CUDA_VISIBLE_DEVICES": devices[index % len(devices)]}


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
