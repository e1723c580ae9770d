"""A real ``loraplex serve`` process on loopback for the hostile benchmark.

The server runs as ``python -m gateway.cli serve`` in its own process (so a SIGKILL, an RSS
reading or a crash is the real thing), with its own data directory, a fixed admin key and the
built-in tiny model (written once per data directory by ``loraplex model init-tiny``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ADMIN_KEY = "lpx-admin-bench-key-0123456789abcdef0123456789"
START_TIMEOUT = 120.0


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tiny(directory: Path, *, text_only: bool = False) -> Path:
    """The built-in tiny model written to ``directory`` (once; later calls reuse it)."""
    if not (directory / "config.json").exists():
        cmd = [sys.executable, "-m", "loraplex.gateway.cli", "model", "init-tiny", str(directory)]
        if text_only:
            cmd.append("--text-only")
        subprocess.run(cmd, check=True, capture_output=True)
    return directory


class LiveServer:
    """``loraplex serve`` in a child process; stdout and stderr go to ``<data>/serve.log``.

    Args:
        data_dir: The server's data directory (kept across :meth:`restart`).
        model: A model directory (``init_tiny``).
        args: Extra ``serve`` flags (``["--db-url", url]``, ``["--num-kv-blocks", "64"]``...).
        env: Extra environment variables.
    """

    def __init__(
        self,
        data_dir: Path,
        model: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.model = Path(model)
        self.args = list(args or [])
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "serve.log"

    # ------------------------------------------------------------------ life cycle
    def start(self, timeout: float = START_TIMEOUT) -> LiveServer:
        """Start the process and wait until ``/health`` answers 200.

        Raises:
            RuntimeError: the process exited or did not become healthy in ``timeout`` s.
        """
        return self.spawn().wait_healthy(timeout)

    def spawn(self) -> LiveServer:
        """Start the process without waiting for it (then :meth:`wait_healthy`).

        So that two servers load their models at once.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env.update(self.extra_env)
        cmd = [sys.executable, "-m", "loraplex.gateway.cli", "serve", "--model", str(self.model)]
        cmd += ["--data-dir", str(self.data_dir), "--port", str(self.port)]
        cmd += ["--admin-key", ADMIN_KEY, "--log-level", "warning", *self.args]
        log = open(self.log_path, "a")  # noqa: SIM115 (the child holds it)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> LiveServer:
        """Wait until ``/health`` answers 200 (after :meth:`spawn`).

        Raises:
            RuntimeError: the process exited or did not become healthy in ``timeout`` s.
        """
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"serve did not become healthy:\n{self.log()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int | None:
        """Send ``sig`` and wait for the exit; returns the exit status (None if it lives on)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def restart(self, sig: int = signal.SIGKILL) -> LiveServer:
        """Stop the process with ``sig`` and start it again on the same data directory."""
        self.kill(sig)
        return self.start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            if self.kill(signal.SIGTERM) is None:
                self.kill(signal.SIGKILL)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --------------------------------------------------------------------- readings
    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def rss_mb(self) -> tuple[float, float]:
        """``(current RSS, peak RSS)`` of the server process in MiB (``/proc``)."""
        assert self.proc is not None
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            fields[name] = value
        return (
            int(fields["VmRSS"].split()[0]) / 1024.0,
            int(fields["VmHWM"].split()[0]) / 1024.0,
        )

    # ---------------------------------------------------------------------- clients
    def client(self, key: str | None = None, timeout: float = 60.0) -> httpx.Client:
        """A synchronous client, with ``Authorization: Bearer key`` when given."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def create_tenant(self, name: str) -> dict[str, str]:
        """``POST /admin/tenants`` -> ``{"id", "name", "api_key"}``.

        Raises:
            RuntimeError: the server refused it.
        """
        with self.client(ADMIN_KEY) as c:
            r = c.post("/admin/tenants", json={"name": name})
        if r.status_code != 201:
            raise RuntimeError(f"creating tenant {name}: {r.status_code} {r.text}")
        return r.json()

    def create_key(self, tenant_id: str) -> str:
        """``POST /admin/tenants/{id}/keys``: another key of the tenant.

        Raises:
            RuntimeError: the server refused it.
        """
        with self.client(ADMIN_KEY) as c:
            r = c.post(f"/admin/tenants/{tenant_id}/keys")
        if r.status_code != 201:
            raise RuntimeError(f"creating a key: {r.status_code} {r.text}")
        return r.json()["api_key"]

    def set_limits(self, tenant_id: str, **limits: int | None) -> None:
        """``PUT /admin/tenants/{id}/limits`` (``requests_per_minute`` ...; None lifts one)."""
        with self.client(ADMIN_KEY) as c:
            r = c.put(f"/admin/tenants/{tenant_id}/limits", json=limits)
        if r.status_code >= 300:
            raise RuntimeError(f"setting limits: {r.status_code} {r.text}")

    def usage(self, key: str) -> dict[str, Any]:
        """``GET /v1/usage`` for the key's tenant."""
        with self.client(key) as c:
            r = c.get("/v1/usage")
        r.raise_for_status()
        return r.json()
