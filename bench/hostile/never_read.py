"""Never-read streams (issue 27 item 3): one key parks streams that are never read.

The attack of the issue's finding: requests with ``n`` 8, ``top_logprobs`` 20, ``max_tokens``
150 (about 1.3-1.8 MB of output each), streamed, sent over sockets with a 4 KiB receive buffer
that are never read, against a ``loraplex serve`` with ``--max-connections 32``. Before the
write deadline the server's writes blocked for ever: 32 such streams held every connection and
every other tenant's chat, ``/health`` and ``/metrics`` answered 503 for as long as the sockets
stayed open.

Measured here, in one run: a bystander tenant's latency (``/health``, a small chat,
``/metrics`` with the admin key; one keep-alive client, sequential) while the server is idle
(before the attack and after it, pooled) and while the streams are parked (after the engine
has finished generating them, so that what is measured is what the parked sockets hold, not
the engine's work), with every bystander status counted: any non-200 while parked is a
connection-table capture. Also: how many of the attacker's streams the server took (the rest
are refused: 429 ``too_many_connections`` past the key's share), how many it still holds once
its write deadline has passed (0 expected: cut, billed ``aborted``), and whether the
attacker's key can chat again afterwards (its concurrency slots are back).

``run(server, bystander_key)`` takes a started :class:`bench.hostile.live.LiveServer` whose
flags include ``--max-connections`` (see :func:`server_flags`); ``python -m
bench.hostile.transport`` and ``python -m bench.hostile`` start one.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.hostile.live import ADMIN_KEY, LiveServer
from loraplex.gateway.server.config import GatewayConfig

TABLE = 32  # --max-connections of the attacked server (the finding's)
STREAMS = 32  # streams the attacker's key tries to park: the whole table
RECEIVE_BUFFER = 4096  # the attacker's SO_RCVBUF
SEGMENT = 1448  # the attacker's TCP_MAXSEG: Ethernet's MSS (see _drive)
ATTACK = {"n": 8, "logprobs": True, "top_logprobs": 20, "max_tokens": 150, "stream": True}
SAMPLES = 25  # bystander rounds per phase
MARGIN = 3.0  # seconds past the write deadline before counting what the server still holds
ENGINE_DONE_TIMEOUT = 90.0  # at most this long waiting for the engine to finish the streams


def server_flags(write_timeout: float | None = None) -> list[str]:
    """``serve`` flags of the attacked server: the finding's table, the write deadline."""
    flags = ["--max-connections", str(TABLE)]
    if write_timeout is not None:
        flags += ["--write-timeout", str(write_timeout)]
    return flags


def write_timeout_of(server: LiveServer) -> float:
    """The server's ``--write-timeout``, else the default (seconds)."""
    args = server.args
    for i, arg in enumerate(args[:-1]):
        if arg == "--write-timeout":
            return float(args[i + 1])
    d = GatewayConfig(data_dir=Path("."), db_url="", served_model_name="")
    return d.write_timeout_seconds


class Parked:
    """``streams`` never-read streams, taking ``keys`` in turn, held by a child process.

    A child process, so that the bystander measured in this one never waits for the GIL
    behind the driver.

    Attributes:
        statuses: After :meth:`start`, per stream the status its response began with
            (``"200"``, ``"429"``, ``"503"``), or ``"closed"`` / ``"no answer"`` /
            ``"refused"`` (could not connect).
        outcomes: After :meth:`finish`, per stream that got 200: ``"cut"`` (reset or closed
            by the server) or ``"open"`` (still held).
    """

    def __init__(self, port: int, keys: list[str], model: str, streams: int) -> None:
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], **ATTACK}
        ).encode()
        requests = [
            (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\nauthorization: Bearer %s\r\n"
                b"content-length: %d\r\n\r\n" % (key.encode(), len(body))
            )
            + body
            for key in keys
        ]
        context = multiprocessing.get_context("spawn")
        self._check = context.Event()
        self._results = context.Queue()
        self._process = context.Process(
            target=_drive, args=(port, requests, streams, self._check, self._results), daemon=True
        )
        self.statuses: list[str] = []
        self.outcomes: list[str] = []

    def start(self) -> Parked:
        """Open every stream; returns once each has the first bytes of its answer.

        Raises:
            RuntimeError: the driver process died or took over 2 minutes.
        """
        self._process.start()
        self.statuses = self._result()
        return self

    def finish(self) -> list[str]:
        """Check which streams the server still holds, then close them all.

        Raises:
            RuntimeError: the driver process died or took over 2 minutes.
        """
        self._check.set()
        self.outcomes = self._result()
        self._process.join(10)
        return self.outcomes

    def _result(self, timeout: float = 120.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self._results.get(timeout=0.5)
            except queue.Empty:
                if not self._process.is_alive():
                    break
        self._process.kill()
        raise RuntimeError("the never-read driver process failed")


def _drive(port, requests, streams, check, results) -> None:
    """The child process: park the streams, report their statuses, later their outcomes.

    Each socket has a 4 KiB receive buffer and Ethernet's segment size, as over a network: on
    loopback the server's kernel sizes its send buffer by the 64 KiB segments and takes
    several MB, more than one whole answer, and the stream would never stall there.
    """
    socks: list[socket.socket | None] = []
    for i in range(streams):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SEGMENT)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(requests[i % len(requests)])
        except OSError:
            sock.close()
            sock = None
        socks.append(sock)
    statuses = []
    for sock in socks:
        if sock is None:
            statuses.append("refused")
            continue
        sock.settimeout(60)
        try:
            head = sock.recv(12, socket.MSG_PEEK)  # the status line, leaving it unread
        except TimeoutError:
            statuses.append("no answer")
            continue
        except OSError:
            statuses.append("closed")
            continue
        statuses.append(head[9:12].decode() if head.startswith(b"HTTP/1.1 ") else "closed")
    results.put(statuses)
    check.wait()
    outcomes = []
    for sock, status in zip(socks, statuses, strict=True):
        if sock is not None and status == "200":
            outcomes.append(_still_held(sock))
    for sock in socks:
        if sock is not None:
            sock.close()
    results.put(outcomes)


def _still_held(sock: socket.socket, seconds: float = 1.0) -> str:
    """``"cut"`` when the server has reset or closed the stream, else ``"open"``.

    Reads what the socket holds: a held stream keeps sending (or waits) for ``seconds``; a
    cut one ends in a reset or end of file once its buffered bytes are read.
    """
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                if not sock.recv(1 << 20):
                    return "cut"
            except TimeoutError:
                continue
    except OSError:  # ConnectionResetError: the server's reset
        return "cut"
    return "open"


def _bystander(client: httpx.Client, model: str, n: int) -> dict[str, list]:
    """``n`` rounds of ``/health``, a 4-token chat and ``/metrics``.

    Returns:
        Per kind, the ms of each answered 200 (a refusal's time is no latency), and under
        ``"statuses"`` every status (or the client's error name).
    """
    out: dict[str, list] = {"health": [], "chat": [], "metrics": [], "statuses": []}
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for _ in range(n):
        for kind, call in (
            ("health", lambda: client.get("/health")),
            ("chat", lambda: client.post("/v1/chat/completions", json=body)),
            ("metrics", lambda: client.get("/metrics", headers=admin)),
        ):
            t = time.perf_counter()
            try:
                status = call().status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            if status == 200:
                out[kind].append((time.perf_counter() - t) * 1e3)
            out["statuses"].append(status)
    return out


def _engine_idle(server: LiveServer, timeout: float) -> bool:
    """Wait until the engine runs and queues no sequence (``/metrics``); False on timeout."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.base_url, timeout=5) as c:
        while time.monotonic() < deadline:
            try:
                r = c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200:
                gauges = dict(
                    line.split(" ", 1)
                    for line in r.text.splitlines()
                    if line.startswith(("loraplex_requests_running ", "loraplex_requests_waiting "))
                )
                if gauges and all(float(v) == 0 for v in gauges.values()):
                    return True
            time.sleep(0.1)
    return False


def run(
    server: LiveServer,
    bystander_key: str,
    streams: int = STREAMS,
    samples: int = SAMPLES,
    keys: int = 1,
    engine_timeout: float = ENGINE_DONE_TIMEOUT,
) -> dict[str, Any]:
    """Park ``streams`` never-read streams of one attacker tenant; measure a bystander.

    Args:
        server: A started server (its ``--write-timeout`` is read from its flags).
        bystander_key: The bystander tenant's key.
        streams: Streams the attacker tries to park.
        samples: Bystander rounds per phase.
        keys: The attacker's keys, taken in turn (the issue's attack: one; with more, one
            tenant can hold the whole table and the stalled writers are evicted instead).
        engine_timeout: How long to wait for the engine to finish the streams before the
            bystander is measured (a server whose table is captured never answers
            ``/metrics``).

    Returns:
        The figures (see the module docstring): the attacker's statuses, the bystander's p50
        latencies idle and while parked (ms), their ratios, its non-200 answers while parked
        (``connection_table_capture``: ``"none"`` when there were none), the streams still
        held after the write deadline, the attacker's chat status afterwards.
    """
    write_timeout = write_timeout_of(server)
    tenant = server.create_tenant(f"never-read-{time.time_ns()}")  # default limits
    attacker = tenant["api_key"]
    attacker_keys = [attacker] + [server.create_key(tenant["id"]) for _ in range(keys - 1)]
    with server.client(bystander_key, timeout=60) as bystander:
        model = bystander.get("/v1/models").json()["data"][0]["id"]
        _bystander(bystander, model, 2)  # warm-up
        before = _bystander(bystander, model, samples)
        started = time.monotonic()
        parked = Parked(server.port, attacker_keys, model, streams).start()
        engine_idle = _engine_idle(server, engine_timeout)
        generated_s = time.monotonic() - started
        during = _bystander(bystander, model, samples)
        measured_s = time.monotonic() - started
        time.sleep(max(0.0, started + generated_s + write_timeout + MARGIN - time.monotonic()))
        outcomes = parked.finish()
        with server.client(attacker, timeout=60) as c:
            attacker_after = c.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "Hi"}]},
            ).status_code
        after = _bystander(bystander, model, samples)
    idle = {kind: before[kind] + after[kind] for kind in ("health", "chat", "metrics")}
    refused_during = [s for s in during["statuses"] if s != 200]
    statuses: dict[str, int] = {}
    for status in parked.statuses:
        statuses[status] = statuses.get(status, 0) + 1
    figures: dict[str, Any] = {
        "never_read_streams": streams,
        "never_read_keys": keys,
        "never_read_statuses": dict(sorted(statuses.items())),
        "never_read_parked": statuses.get("200", 0),
        "never_read_engine_done_s": round(generated_s, 1) if engine_idle else None,
        "never_read_measured_while_held": measured_s < write_timeout,
        "connection_table_capture": (
            "none"
            if not refused_during
            else f"{len(refused_during)} of {len(during['statuses'])} bystander requests "
            f"refused ({sorted(set(map(str, refused_during)))})"
        ),
        "never_read_bystander_refused_while_parked": len(refused_during),
        "never_read_bystander_refused_idle": sum(
            1 for s in before["statuses"] + after["statuses"] if s != 200
        ),
    }
    for kind in ("health", "chat", "metrics"):  # None: not one answer (all refused)
        idle_p50 = statistics.median(idle[kind]) if idle[kind] else None
        parked_p50 = statistics.median(during[kind]) if during[kind] else None
        ratio = None if idle_p50 is None or parked_p50 is None else parked_p50 / idle_p50
        figures[f"never_read_bystander_{kind}_p50_ms_idle"] = _round(idle_p50)
        figures[f"never_read_bystander_{kind}_p50_ms_parked"] = _round(parked_p50)
        figures[f"never_read_bystander_{kind}_ratio"] = _round(ratio)
    figures.update(
        never_read_held_after_deadline=outcomes.count("open"),
        never_read_cut=outcomes.count("cut"),
        never_read_attacker_chat_after=attacker_after,
        never_read_write_timeout_s=write_timeout,
        never_read_seconds=round(time.monotonic() - started, 1),
    )
    return figures


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def rows(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """The readable table's rows for :func:`run`'s figures."""
    ratios = ", ".join(
        f"{kind} {figures[f'never_read_bystander_{kind}_p50_ms_idle']} -> "
        f"{figures[f'never_read_bystander_{kind}_p50_ms_parked']} ms "
        f"(x{figures[f'never_read_bystander_{kind}_ratio']})"
        for kind in ("health", "chat", "metrics")
    )
    return [
        (
            "never-read streams",
            f"{figures['never_read_streams']} tried by {figures['never_read_keys']} key(s) of "
            f"one tenant: {json.dumps(figures['never_read_statuses'])}",
        ),
        ("connection-table capture", str(figures["connection_table_capture"])),
        ("bystander p50 idle -> parked", ratios),
        (
            "held after the write deadline",
            f"{figures['never_read_held_after_deadline']} "
            f"({figures['never_read_cut']} cut, --write-timeout "
            f"{figures['never_read_write_timeout_s']} s)",
        ),
        ("attacker's chat afterwards", str(figures["never_read_attacker_chat_after"])),
    ]
