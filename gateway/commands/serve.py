"""``loraplex serve``: the gateway and the engine (the README's main job; docs/cli.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from loraplex.engine.config import EngineConfig
from loraplex.gateway.commands.engine_args import add_engine_args, config_from_args
from loraplex.gateway.server.config import GatewayConfig

logger = logging.getLogger("loraplex.serve")
_REDIS_SCHEMES = ("redis", "rediss", "unix")


def register(subparsers) -> None:
    """Add the ``serve`` command."""
    p = subparsers.add_parser("serve", help="run the HTTP gateway and the engine")
    d = GatewayConfig(data_dir=None, db_url="", served_model_name="")  # type: ignore[arg-type]
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="TCP port to listen on")
    p.add_argument(
        "--db-url",
        default=None,
        help="SQLAlchemy async URL, e.g. postgresql+asyncpg://user:pass@host/db "
        "(default $LORAPLEX_DB_URL, else SQLite in the data directory)",
    )
    p.add_argument(
        "--admin-key", default=None, help="admin key (default $LORAPLEX_ADMIN_KEY, else made)"
    )
    p.add_argument(
        "--adapter-store",
        default=None,
        metavar="DIR_OR_URL",
        help="the content-addressed store of uploaded adapters, which every gateway and engine "
        "replica reads: a directory (a shared file system for several machines) or an "
        "object-store URL such as s3://bucket/prefix (fsspec; s3fs for s3://) (default "
        "DATA_DIR/adapters)",
    )
    p.add_argument(
        "--rate-limit-url",
        default=None,
        metavar="URL",
        help="Redis URL (redis://host:6379/0) where the per-key rate limits live, shared by "
        "every gateway that names it; if Redis fails, each gateway limits on its own until it "
        "answers (default $LORAPLEX_RATE_LIMIT_URL, else in this process)",
    )
    add_engine_args(p, core_process=True)
    g = p.add_argument_group("limits (per key; a tenant's own limits override them)")
    g.add_argument(
        "--requests-per-minute",
        type=int,
        default=d.default_requests_per_minute,
        help="requests per minute per key; 429 with Retry-After beyond; 0: unlimited (default "
        "%(default)s)",
    )
    g.add_argument(
        "--tokens-per-minute",
        type=int,
        default=d.default_tokens_per_minute,
        help="prompt + completion tokens per minute per key; 429 with Retry-After beyond; 0: "
        "unlimited (default %(default)s)",
    )
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=d.default_max_concurrent_requests,
        help="requests in flight per key; 429 beyond; 0: unlimited (default %(default)s)",
    )
    g.add_argument(
        "--max-tokens-limit",
        type=int,
        default=d.max_tokens_limit,
        help="largest max_tokens a request may ask for; 400 beyond",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=d.shutdown_grace_seconds,
        help="seconds in-flight requests may run after SIGINT / SIGTERM before they are aborted",
    )
    a = p.add_argument_group(
        "admission control (all tenants; past a bound new requests get 503 + Retry-After)"
    )
    a.add_argument(
        "--max-outstanding-requests",
        type=int,
        default=d.max_outstanding_requests,
        help="chat requests in progress at most (0: no bound; default %(default)s)",
    )
    a.add_argument(
        "--max-outstanding-tokens",
        type=int,
        default=d.max_outstanding_tokens,
        help="their prompt + max_tokens at most (0: no bound; default %(default)s)",
    )
    a.add_argument(
        "--max-concurrent-uploads",
        type=int,
        default=d.max_concurrent_uploads,
        help="adapter uploads processed at once, server-wide (default %(default)s)",
    )
    a.add_argument(
        "--batch-file-max-bytes",
        type=int,
        default=d.batch_file_max_bytes,
        help="largest /v1/files upload in bytes (default %(default)s)",
    )
    a.add_argument(
        "--batch-max-requests",
        type=int,
        default=d.batch_max_requests,
        help="most lines one batch input file may hold (default %(default)s)",
    )
    a.add_argument(
        "--batch-concurrency",
        type=int,
        default=d.batch_concurrency,
        help="lines of one batch in flight at once (default %(default)s)",
    )
    a.add_argument(
        "--tenant-share",
        type=float,
        default=d.tenant_share,
        help="fraction of each bound one tenant may hold (default %(default)s)",
    )
    add_transport_args(p, d)
    u = p.add_argument_group("usage ledger")
    u.add_argument(
        "--usage-fsync",
        action=argparse.BooleanOptionalAction,
        default=d.usage_spool_fsync,
        help="fdatasync each group of usage rows before the responses end: durable through a "
        "power loss; without it, through a process crash only (default %(default)s)",
    )
    u.add_argument(
        "--usage-backlog-limit",
        type=int,
        default=d.usage_backlog_limit,
        help="usage rows that may wait for an unreachable database; past it, chat requests get "
        "503 (default %(default)s)",
    )
    p.add_argument(
        "--metrics-max-adapter-labels",
        type=int,
        default=d.metrics_max_adapter_labels,
        help="adapters that get a model_name label of their own in /metrics (TENANT_ID/NAME; the "
        "first to be used, at most a quarter per tenant; the rest share '(other)'); 0 shows no "
        "adapter name on /metrics (default %(default)s)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        metavar="PORT",
        help="also listen on this port (0: any free one) for GET /metrics without a key, and "
        "nothing else; on the API port /metrics takes the admin key (default: no metrics "
        "listener)",
    )
    p.add_argument(
        "--metrics-host",
        default=d.metrics_host,
        metavar="HOST",
        help="address of the --metrics-port listener; anyone who reaches it reads every "
        "tenant's counters (default %(default)s)",
    )
    p.add_argument(
        "--disable-docs",
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /docs (Swagger UI) and no /openapi.json; vLLM's --disable-fastapi-docs "
        "is the same flag (default: both served, without a key)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core (scheduler and model) in its own process, restarted if it "
        "dies while the gateway keeps serving; --no-engine-process runs it on a thread of the "
        "gateway's process, which then exits if it dies (default: own process)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="engine cores behind one router that sends each request where its prefix is "
        "cached and its adapter loaded, weighed against queued work (docs/scale_out.md); "
        "each core gets 1/N of the automatic CPU KV share (default %(default)s)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="place the engine cores as Ray actors on this cluster: auto (the cluster this "
        "host belongs to), a GCS address, or local (a new Ray instance on this machine); one "
        "GPU each with --device cuda (default: child processes of this one)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe log record written (info and debug include the access log)",
    )
    p.add_argument(
        "--no-access-log",
        action="store_true",
        help="no line per request on stdout (written at --log-level info and debug)",
    )
    p.set_defaults(func=run)


def add_transport_args(p: argparse.ArgumentParser, d: GatewayConfig) -> None:
    """The connection limits' flags (:mod:`gateway.transport`, the auth throttle)."""
    t = p.add_argument_group("connections (per client connection and address)")
    t.add_argument(
        "--max-header-bytes",
        type=int,
        default=d.max_header_bytes,
        help="bytes of URL plus header names and values per request; 431 beyond "
        "(default %(default)s)",
    )
    t.add_argument(
        "--max-headers",
        type=int,
        default=d.max_headers,
        help="header fields per request; 431 beyond (default %(default)s)",
    )
    t.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_seconds,
        help="seconds a request's head may take from its first byte; 408 and closed beyond "
        "(default %(default)s)",
    )
    t.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_seconds,
        help="seconds a request body may take after its head, plus its bytes over "
        "--body-min-rate; 408 and closed beyond (default %(default)s)",
    )
    t.add_argument(
        "--body-min-rate",
        type=int,
        default=d.body_min_bytes_per_second,
        help="bytes per second of body that keep extending its deadline; 0: a fixed "
        "--body-timeout (default %(default)s)",
    )
    t.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open client connections at most: past it the longest-waiting idle one is "
        "closed, else the longest-stalled writer is reset, else the newcomer gets 503 "
        "(default %(default)s)",
    )
    t.add_argument(
        "--max-connections-per-key",
        type=int,
        default=d.max_connections_per_key,
        help="open connections one API key may hold; past it its idle one is closed, else "
        "429 (default: a quarter of --max-connections)",
    )
    t.add_argument(
        "--write-timeout",
        type=float,
        default=d.write_timeout_seconds,
        help="seconds a response may wait for a client that stopped reading, plus the bytes "
        "it reads meanwhile over --write-min-rate; the connection is reset beyond and the "
        "request billed aborted (default %(default)s)",
    )
    t.add_argument(
        "--write-min-rate",
        type=int,
        default=d.write_min_bytes_per_second,
        help="bytes per second a reading client takes that keep extending its write "
        "deadline; 0: a fixed --write-timeout (default %(default)s)",
    )
    t.add_argument(
        "--auth-max-failures",
        type=int,
        default=d.auth_max_failures,
        help="failed authentications (401) per client address and window before 429; "
        "0: no throttle (default %(default)s)",
    )
    t.add_argument(
        "--auth-failure-window",
        type=float,
        default=d.auth_failure_window_seconds,
        help="seconds of the failed-authentication window (default %(default)s)",
    )
    t.add_argument(
        "--forwarded-allow-ips",
        default=d.forwarded_allow_ips,
        help="comma-separated proxy addresses (or '*') whose X-Forwarded-For is believed "
        "for the client address; default: none, the TCP peer is the client",
    )


def serve_engine_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    """The engine config ``serve`` runs: the engine flags, the core process's timeouts checked.

    ``--engine-dead-timeout`` and ``--engine-step-timeout``: how long a silent or stuck engine
    core process is waited for (``engine.client.process``); they watch a process, so they are
    refused with ``--no-engine-process``. ``--cpu-threads-bind`` lists: one per replica, and
    only for engine core processes of this machine when there are several
    (``engine.core.cpu_bind.check_bind``).

    Raises:
        ValueError: an invalid flag or combination.
    """
    if not args.dead_timeout_s >= 1.0 or not args.step_timeout_s > 0:
        raise ValueError(
            "--engine-dead-timeout must be at least 1 and --engine-step-timeout positive"
        )
    default = EngineConfig(model="")
    timeouts = (args.unresponsive_timeout_s, args.dead_timeout_s, args.step_timeout_s)
    defaults = (default.unresponsive_timeout_s, default.dead_timeout_s, default.step_timeout_s)
    if not args.engine_process and timeouts != defaults:
        raise ValueError(
            "--engine-unresponsive-timeout, --engine-dead-timeout and --engine-step-timeout "
            "watch an engine core process; with --no-engine-process there is none"
        )
    config = config_from_args(args, model_dir)
    from loraplex.engine.core.cpu_bind import check_bind

    replicas = getattr(args, "replicas", 1)
    if replicas >= 1:  # below 1: refused by start_engine, with its own line
        remote = getattr(args, "ray_address", None) is not None
        in_process = not args.engine_process and not remote
        check_bind(config.cpu_threads_bind, replicas, in_process=in_process, remote=remote)
    return config


def gateway_config_from_args(args: argparse.Namespace, served_model_name: str) -> GatewayConfig:
    """The gateway settings for ``serve``'s flags.

    Raises:
        ValueError: a limit that is not positive.
    """
    from pathlib import Path

    from loraplex.adapters.object_store import is_url
    from loraplex.gateway.db.session import db_url
    from loraplex.gateway.settings import data_dir

    directory = data_dir(args.data_dir)
    store = args.adapter_store
    rate_limit_url = args.rate_limit_url or os.environ.get("LORAPLEX_RATE_LIMIT_URL") or None
    if rate_limit_url is not None and rate_limit_url.split("://")[0] not in _REDIS_SCHEMES:
        raise ValueError("--rate-limit-url must be a redis://, rediss:// or unix:// URL")
    for flag in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be 0 (unlimited) or positive")
    for flag in ("max_outstanding_requests", "max_outstanding_tokens"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be 0 (no bound) or positive")
    if args.usage_backlog_limit < 1:
        raise ValueError("--usage-backlog-limit must be at least 1")
    if args.metrics_max_adapter_labels < 0:
        raise ValueError("--metrics-max-adapter-labels must not be negative")
    if args.max_concurrent_uploads < 1:
        raise ValueError("--max-concurrent-uploads must be at least 1")
    for flag in ("batch_file_max_bytes", "batch_max_requests", "batch_concurrency"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0.0 < args.tenant_share <= 1.0:
        raise ValueError("--tenant-share must be in (0, 1]")
    for flag in (
        "max_header_bytes",
        "max_headers",
        "header_timeout",
        "body_timeout",
        "max_connections",
        "write_timeout",
        "auth_failure_window",
    ):
        if not getattr(args, flag) > 0:  # NaN included
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    if args.max_connections_per_key is not None and not args.max_connections_per_key > 0:
        raise ValueError("--max-connections-per-key must be positive")
    for flag in ("body_min_rate", "write_min_rate", "auth_max_failures"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must not be negative")
    return GatewayConfig(
        data_dir=directory,
        db_url=db_url(directory, args.db_url),
        served_model_name=served_model_name,
        host=args.host,
        port=args.port,
        max_tokens_limit=args.max_tokens_limit,
        default_requests_per_minute=args.requests_per_minute or None,
        default_tokens_per_minute=args.tokens_per_minute or None,
        default_max_concurrent_requests=args.max_concurrent_requests or None,
        shutdown_grace_seconds=args.shutdown_grace,
        max_outstanding_requests=args.max_outstanding_requests or None,
        max_outstanding_tokens=args.max_outstanding_tokens or None,
        tenant_share=args.tenant_share,
        max_concurrent_uploads=args.max_concurrent_uploads,
        batch_file_max_bytes=args.batch_file_max_bytes,
        batch_max_requests=args.batch_max_requests,
        batch_concurrency=args.batch_concurrency,
        usage_spool_fsync=args.usage_fsync,
        usage_backlog_limit=args.usage_backlog_limit,
        metrics_max_adapter_labels=args.metrics_max_adapter_labels,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        header_timeout_seconds=args.header_timeout,
        body_timeout_seconds=args.body_timeout,
        body_min_bytes_per_second=args.body_min_rate,
        max_connections=args.max_connections,
        max_connections_per_key=args.max_connections_per_key,
        write_timeout_seconds=args.write_timeout,
        write_min_bytes_per_second=args.write_min_rate,
        auth_max_failures=args.auth_max_failures,
        auth_failure_window_seconds=args.auth_failure_window,
        forwarded_allow_ips=args.forwarded_allow_ips,
        adapter_store_dir=None if store is None or is_url(store) else Path(store),
        adapter_store_url=store if store is not None and is_url(store) else None,
        rate_limit_url=rate_limit_url,
        docs=not args.disable_docs,
    )


def run(args: argparse.Namespace) -> int:
    """Bind the address, load the model, migrate, serve until SIGINT/SIGTERM.

    The listening address is bound first, before anything heavy is imported, so a port in use
    fails at once; progress lines go to stderr from then on (:mod:`gateway.server.startup`).

    Returns:
        0 after a graceful shutdown; 1 when the address cannot be bound or the engine died.
    """
    from loraplex.gateway.server.startup import bind_listeners, progress, url_of

    try:
        sockets = bind_listeners(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(
            f"loraplex serve: error: cannot listen on {args.host}:{args.port}: {reason}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    port = sockets[0].getsockname()[1]
    progress(
        f"listening address {url_of(args.host, port)} is ours (bound first; connections wait "
        "until the server is ready)"
    )
    try:
        try:
            metrics_port = _bind_metrics(args, port, sockets)
        except OSError as exc:
            print(
                f"loraplex serve: error: cannot listen on {args.metrics_host}:"
                f"{args.metrics_port} for metrics: {exc.strerror or exc}",
                file=sys.stderr,
                flush=True,
            )
            return 1
        return _serve(args, sockets, port, metrics_port)
    finally:
        for sock in sockets:
            sock.close()


def _bind_metrics(args: argparse.Namespace, port: int, sockets: list) -> int | None:
    """Bind the metrics listener (``--metrics-port``) and add its sockets to ``sockets``.

    Returns:
        Its port as bound; None without ``--metrics-port``.

    Raises:
        OSError: a port out of range or the API's own, or the address cannot be bound.
    """
    import errno

    from loraplex.gateway.server.startup import bind_listeners, progress, url_of

    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port <= 65535 or args.metrics_port == args.port != 0:
        raise OSError(errno.EINVAL, "the port must be 0 to 65535 and differ from --port")
    bound = bind_listeners(args.metrics_host, args.metrics_port)
    sockets.extend(bound)
    metrics_port = bound[0].getsockname()[1]
    if metrics_port == port:  # two hosts, one port: requests could not be told apart
        raise OSError(errno.EADDRINUSE, "the API listens on the same port")
    url = url_of(args.metrics_host, metrics_port)
    progress(f"metrics listener {url}/metrics is ours (GET /metrics without a key, nothing else)")
    return metrics_port


def _serve(args: argparse.Namespace, sockets: list, port: int, metrics_port: int | None) -> int:
    """Everything after the bind: model, engine, database, then uvicorn on ``sockets``.

    ``sockets`` holds the metrics listener's too when ``metrics_port`` is not None.
    """
    import time

    from loraplex.gateway.auth.redact import RedactingFilter
    from loraplex.gateway.auth.secrets_store import load_or_create_admin_key
    from loraplex.gateway.server.startup import keep_triton_out, process_age, progress, url_of
    from loraplex.gateway.settings import TINY_MODEL_SUBDIR, data_dir, resolve_model

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().addFilter(RedactingFilter())
    directory = data_dir(args.data_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tiny = directory / TINY_MODEL_SUBDIR
    if not args.model and not (tiny / "config.json").exists():
        progress(f"writing the built-in tiny model to {tiny} (first start)")
    engine_config = serve_engine_config(args, resolve_model(args.model, directory))
    if engine_config.kv_disk_bytes and engine_config.kv_disk_dir is None:
        engine_config = engine_config.replace(kv_disk_dir=str(directory / "kv_tiers"))
    if engine_config.attention_backend != "triton":
        keep_triton_out()  # transformers' configs import torch._dynamo, which imports triton
    from loraplex.engine.models.source import resolve_model_source

    # A Hub id is fetched (or found in the HF cache), a GGUF file converted, here, once: the
    # engine core processes get the directory. A failure is one line (ModelSourceError).
    engine_config = resolve_model_source(engine_config, progress=progress)
    shown = engine_config.model
    if engine_config.model_source != shown:  # a Hub id or a GGUF file: what, and from where
        shown = f"{engine_config.model_source} from {shown}"
    # Loading starts with the imports (torch, transformers, the gateway): seconds of it.
    progress(f"loading model {shown} (torch, transformers, then the weights)")
    t0 = time.monotonic()

    from loraplex.gateway.server.build import build_gateway, served_name, start_engine

    gateway_config = gateway_config_from_args(args, served_name(engine_config))
    gateway_config = gateway_config.replace(port=port, metrics_port=metrics_port)
    admin_key, admin_path, created = load_or_create_admin_key(directory, args.admin_key)
    from loraplex.engine.client.quarantine import Quarantine

    client = start_engine(
        engine_config,
        gateway_config.store_location,
        in_process=not args.engine_process,
        replicas=args.replicas,
        ray_address=args.ray_address,
        quarantine=Quarantine(directory / "quarantine.jsonl"),  # shared by its gateways
    )
    try:
        _report_engine(client, gateway_config.served_model_name, time.monotonic() - t0)
        app, state = build_gateway(gateway_config, client, admin_key=admin_key, progress=progress)
    except BaseException:
        client.shutdown()
        raise
    where = (
        f"written to {admin_path}"
        if created
        else (f"in {admin_path}" if admin_path else "from --admin-key / $LORAPLEX_ADMIN_KEY")
    )
    progress(f"admin key {where}")

    from loraplex.gateway.server.metrics_listener import split_listeners
    from loraplex.gateway.transport.access_log import AccessLog
    from loraplex.gateway.transport.graceful import GracefulServer
    from loraplex.gateway.transport.uvicorn_config import uvicorn_config

    served = split_listeners(app, state)  # the metrics listener's requests, if any, apart
    access = None
    if not args.no_access_log and args.log_level in ("debug", "info"):
        access = AccessLog(served)  # instead of uvicorn's: a tenth of the server's CPU per request
    url = url_of(gateway_config.host, port)
    server = GracefulServer(
        uvicorn_config(  # httptools with the connection limits
            access or served,
            gateway_config,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=max(1, round(gateway_config.shutdown_grace_seconds)),
        ),
        state,
        on_ready=lambda: progress(
            f"ready on {url}: {gateway_config.served_model_name}, "
            f"{process_age():.1f} s after launch"
        ),
    )
    server.run(sockets)  # writes the access log's last lines when it ends
    if server.exit_code:
        progress("the engine stopped; exiting so a supervisor restarts the server")
    return server.exit_code


def _report_engine(client, name: str, seconds: float) -> None:
    """The model and KV pool lines: what was loaded, and what the pool holds."""
    from loraplex.gateway.server.startup import progress

    info = client.describe()
    where = f" (engine core: process {info['pid']})" if info.get("pid") else " (in process)"
    if info.get("replicas"):
        first = f"the first is process {info['pid']}" if info.get("pid") else "in process"
        where = f" ({info['replicas']} engine replicas behind a router; {first})"
    if info.get("cpu_threads") and info.get("device") == "cpu":  # "2 torch threads on CPUs 0-1"
        where = f"{where[:-1]}; {info['cpu_threads']})"
    progress(
        f"model {name} loaded: {_count(info['num_parameters'])} parameters, "
        f"{info['dtype']} on {info['device']}, in {seconds:.1f} s{where}"
    )
    progress(f"{info['kv_pool']}; max_model_len {client.max_model_len}")


def _count(n: int) -> str:
    """``1234567`` -> ``1.23M``."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
