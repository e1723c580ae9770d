"""The gateway's own settings (the engine has :class:`engine.config.EngineConfig`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

MiB = 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    """What ``loraplex serve`` configures besides the engine. Frozen; derive with :meth:`replace`.

    Attributes:
        data_dir: The data directory (database, secrets, adapter store).
        db_url: SQLAlchemy async URL of the usage database.
        served_model_name: The base model's name in ``model`` fields and ``/v1/models``.
        host: Bind address.
        port: Bind port.
        chat_max_body_bytes: Largest ``/v1/chat/completions`` body (images inline); 413 beyond.
        upload_max_body_bytes: Largest ``/v1/adapters`` body; 413 beyond. The limit in force is
            the smaller of this and what the largest valid adapter for the served model needs
            (:class:`gateway.domains.adapters.limits.UploadLimits`).
        max_archive_members: Most entries an uploaded archive may hold.
        max_archive_unpacked_bytes: Most bytes an uploaded archive may unpack to (the smaller
            of this and the largest valid adapter plus 1 MiB of other members is in force).
        max_tokens_limit: Largest ``max_tokens`` a request may ask for (also bounded by the
            model length); 400 beyond.
        max_n: Largest ``n``; for a Completions batch, of prompts x ``n`` (choices per request).
        default_requests_per_minute: Per-key requests per minute when the tenant sets none
            (None: unlimited).
        default_tokens_per_minute: Per-key prompt + completion tokens per minute (None: unlimited).
        default_max_concurrent_requests: Per-key requests in flight (None: unlimited).
        auth_cache_seconds: How long a verified key stays cached (revocations through the admin
            API take effect at once; ``loraplex keys revoke`` from another process within this).
        usage_flush_seconds: How long the usage writer gathers rows into one database
            transaction (rows are durable in the spool meanwhile; ``GET /v1/usage`` and
            shutdown write what is queued first).
        shutdown_grace_seconds: On shutdown, how long in-flight requests may run before they
            are aborted.
        adapter_store_dir: The content-addressed adapter store (default ``DATA/adapters``); the
            engine's adapter loader must read the same store.
        adapter_store_url: Instead, an object-store URL (``s3://bucket/prefix``;
            ``adapters.object_store``) every gateway and replica reads.
        max_outstanding_requests: Chat requests admitted and not finished, at most, across all
            tenants; past it, 503 + ``Retry-After`` (None: no bound).
        max_outstanding_tokens: Their prompt + max_tokens, at most (None: no bound).
        tenant_share: Fraction of each of those two bounds one tenant may hold.
        max_header_bytes: Bytes of URL plus header names and values one request may send; 431
            and the connection closed beyond (:mod:`gateway.transport`).
        max_headers: Header fields one request may send; 431 beyond.
        header_timeout_seconds: Seconds a request's head may take from its first byte (from the
            connection's opening for the first request); 408 and closed beyond.
        body_timeout_seconds: Seconds a request body may take after its head, plus
            ``received bytes / body_min_bytes_per_second``; 408 and closed beyond.
        body_min_bytes_per_second: The body rate that keeps extending its deadline (0: the
            deadline is ``body_timeout_seconds`` whatever arrives).
        max_connections: Open client connections at most; past it the one waiting longest
            without a running request is closed, else the writer whose client stopped reading
            longest is reset, else the newcomer gets 503.
        write_timeout_seconds: Seconds a response write may wait for a client that stopped
            reading, plus ``bytes it takes meanwhile / write_min_bytes_per_second``; the
            connection is reset beyond and a chat request billed ``aborted`` (nginx's
            ``send_timeout``; :mod:`gateway.transport`).
        write_min_bytes_per_second: The reading rate that keeps extending the write deadline
            (0: ``write_timeout_seconds`` per pause whatever the client takes).
        max_connections_per_key: Open connections one API key may hold; None: a quarter of
            ``max_connections``. Past it the key's idle connection is closed, else 429.
        auth_max_failures: Failed authentications (401) one client address may make per window
            before it gets 429 with ``Retry-After`` (0: no throttle;
            :mod:`gateway.limits.auth_throttle`).
        auth_failure_window_seconds: The window of ``auth_max_failures``, from the first failure.
        auth_throttle_max_clients: Client addresses the throttle remembers at most.
        forwarded_allow_ips: Comma-separated proxy addresses (or ``*``) whose
            ``X-Forwarded-For`` / ``X-Forwarded-Proto`` are believed (uvicorn's
            ``forwarded_allow_ips``); None: never, the TCP peer is the client.
        max_concurrent_uploads: Adapter uploads processed at once (read back or unpacked,
            validated, stored), server-wide; others wait holding only their spooled body on
            disk. Each holds at most the largest valid adapter for the served model.
        usage_spool_dir: Where usage rows are made durable before a response ends (default
            ``DATA/usage-spool``; ``docs/usage.md``). Rows not yet in the database when the
            process dies are written from here at the next start.
        usage_spool_fsync: ``fdatasync`` each group of spooled rows (durable through power
            loss); False only writes them (durable through a process crash: SIGKILL, OOM).
        usage_backlog_limit: Most usage rows waiting for an unreachable database; past it, chat
            requests get 503 + ``Retry-After`` (bounds the memory and spool an outage takes).
        auth_stale_if_error_seconds: While the database is unreachable, a key verified within
            this many seconds keeps working (its cached verification is served); other keys
            get 503 + ``Retry-After``.
        metrics_max_adapter_labels: Adapters that get a ``model_name`` label of their own in
            ``/metrics`` (``TENANT_ID/NAME``), the first to answer a request since start, at
            most a quarter of them per tenant; the others share ``(other)``. 0: no adapter
            name is shown (``docs/metrics.md``).
        rate_limit_url: A Redis URL where the per-key limits live, shared by every gateway
            that names it (``gateway.limits.ratelimit_shared``); None: in this process.
        metrics_host: Bind address of the metrics listener (loopback unless told otherwise).
        metrics_port: Its port: a listener that answers ``GET /metrics`` without a key and
            nothing else (:mod:`gateway.server.metrics_listener`); None: no such listener
            (``/metrics`` on the API port takes the admin key either way).
        docs: Serve ``/docs`` (Swagger UI) and ``/openapi.json`` without a key
            (:mod:`gateway.server.docs`); False (``serve --disable-docs``): neither exists.
    """

    data_dir: Path
    db_url: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    chat_max_body_bytes: int = 32 * MiB
    upload_max_body_bytes: int = 512 * MiB
    max_archive_members: int = 16
    max_archive_unpacked_bytes: int = 1024 * MiB
    max_tokens_limit: int = 4096
    max_n: int = 8
    default_requests_per_minute: int | None = 600
    default_tokens_per_minute: int | None = 1_000_000
    default_max_concurrent_requests: int | None = 64
    auth_cache_seconds: float = 2.0
    usage_flush_seconds: float = 0.2
    shutdown_grace_seconds: float = 10.0
    adapter_store_dir: Path | None = None
    adapter_store_url: str | None = None
    max_outstanding_requests: int | None = 1024
    max_outstanding_tokens: int | None = 4 * 1024 * 1024
    tenant_share: float = 0.5
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 20.0
    body_min_bytes_per_second: int = 16 * 1024
    max_connections: int = 1024
    write_timeout_seconds: float = 30.0
    write_min_bytes_per_second: int = 1024
    max_connections_per_key: int | None = None
    auth_max_failures: int = 20
    auth_failure_window_seconds: float = 60.0
    auth_throttle_max_clients: int = 65536
    forwarded_allow_ips: str | None = None
    max_concurrent_uploads: int = 2
    usage_spool_dir: Path | None = None
    usage_spool_fsync: bool = True
    usage_backlog_limit: int = 100_000
    auth_stale_if_error_seconds: float = 300.0
    metrics_max_adapter_labels: int = 32
    rate_limit_url: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    docs: bool = True
    batch_file_max_bytes: int = 100 * MiB
    batch_max_requests: int = 50_000
    batch_concurrency: int = 16
    batch_max_running: int = 4
    batch_lease_seconds: float = 30.0
    batch_max_files_per_tenant: int = 100
    batch_max_active_per_tenant: int = 4

    @property
    def store_dir(self) -> Path:
        """Where uploaded adapters are stored, when in a directory."""
        return self.adapter_store_dir or self.data_dir / "adapters"

    @property
    def store_location(self) -> str:
        """The adapter store every gateway and replica opens (``adapters.object_store``)."""
        return self.adapter_store_url or str(self.store_dir)

    @property
    def spool_dir(self) -> Path:
        """The usage spool directory."""
        return self.usage_spool_dir or self.data_dir / "usage-spool"

    @property
    def dead_letter_path(self) -> Path:
        """Where usage rows the database refused are set aside (JSON lines)."""
        return self.data_dir / "usage-dead-letter.jsonl"

    @property
    def files_dir(self) -> Path:
        """Where ``/v1/files`` keeps files' bytes (and batches their progress)."""
        return self.data_dir / "files"

    def replace(self, **changes: object) -> GatewayConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)
