"""An engine core in its own process, as an :class:`EngineCoreClient` (vLLM v1's ``MPClient``).

:class:`ProcessCoreClient` starts ``engine.core.process.run_core`` in a child process (``spawn``:
no CUDA or thread state is inherited) or a Ray actor (``engine.core.launch``), and talks to it
with the typed messages of ``engine.core.wire`` over two ZMQ PUSH/PULL sockets on private IPC
paths (TCP for a remote actor). It deals in token ids only: outputs go to the front's sink
(``engine.client.front.AsyncLLM``), which detokenizes. A reader thread polls the core's socket
and the child's process sentinel together, so a core that dies is noticed at once (well within
a second):

1. every in-flight request's stream ends with :class:`EngineDeadError` (the gateway answers
   503 and records the request as aborted), and pending calls fail with it too;
2. ``is_running`` is False (``/health`` fails) while a new core starts, after a back-off of
   0.5 s doubling to 8 s;
3. when the new core is ready, service resumes; adapters are read again from the store on
   demand. More than :data:`MAX_RESTARTS` restarts within :data:`RESTART_WINDOW_S` and the
   client gives up for good (``failed`` is True, ``is_running`` stays False), so a core that
   crashes at start-up cannot spin.

A core that stops answering without dying (frozen, swapped out, its node cut off, its loop
stuck) is caught by its heartbeat (``engine.core.process``: every 0.1 s from a thread of its own,
with the running step's age). Silent for the config's ``unresponsive_timeout_s`` (1 s), it is
not running as far as ``is_running`` goes (a replica set stops routing to it, ``/health``
fails) but it is ``recovering``: heard again, it serves again. Silent for ``dead_timeout_s``
(10 s), or one step older than ``step_timeout_s`` (600 s), it is killed and handled as a death
(1-3 above), so no request waits on it for longer than that.

A death is blamed on the requests in flight (``engine.client.quarantine``, the breadcrumb of
``engine.core.breadcrumb``): a request that keeps killing cores is refused before it is sent
(docs/hardening.md).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loraplex.engine.client.core_client import EngineCoreClient, FinishRequest, OutputSink
from loraplex.engine.client.quarantine import Quarantine, Suspect, request_digest
from loraplex.engine.client.streams import settle
from loraplex.engine.core import breadcrumb, wire
from loraplex.engine.core.launch import ProcessLauncher
from loraplex.engine.errors import EngineDeadError, rejection_error
from loraplex.engine.request import EngineRequest

logger = logging.getLogger(__name__)

_NOBLOCK = 1  # zmq.NOBLOCK (zmq is imported where it is used)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
READY_TIMEOUT_S = 900.0  # a big model on a slow disk


class ProcessCoreClient(EngineCoreClient):
    """An engine core in a child process (or a Ray actor), restarted when it dies.

    Args:
        config: The ``EngineConfig`` (sent to the child as its start argument, its model
            resolved here first: a child or a Ray replica never downloads or converts it;
            ``engine.models.source``).
        store_root: The adapter store the core reads adapters from by digest, or None.
        launcher: Where cores run (``engine.core.launch``): a child process (the default)
            or a Ray actor.
        quarantine: What deaths this client and its peers (the other replicas, the other
            gateways of the data directory) have seen (``engine.client.quarantine``); a new one in
            memory when None.

    Raises:
        RuntimeError: (from :meth:`start`) the first core exited or did not become ready.
    """

    def __init__(
        self,
        config: Any,
        store_root: str | None,
        launcher: Any = None,
        quarantine: Quarantine | None = None,
    ) -> None:
        self.config = config  # resolved by whoever made it (gateway build, front); a core
        # given an unresolved Hub id resolves it itself (EngineCore)
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.launcher = launcher if launcher is not None else ProcessLauncher()
        self.store_root = store_root
        self._sink: OutputSink | None = None
        self.info: wire.CoreInfo | None = None
        self.failed = False  # gave up restarting
        self.restarts = 0
        self.deaths = 0  # cores that died under this client
        self.quarantine_refusals = 0  # requests refused by the quarantine
        self._deaths: list[tuple[float, str]] = []  # (monotonic time, quarantine key)
        # digest, tenant and send count (AddRequest.seq) of each request in flight: suspects
        self._sent: dict[str, tuple[str, str | None, int]] = {}
        self._seq = 0  # requests sent
        # ``taken`` of the latest three Outputs: what the core had taken, in its own terms
        self._taken: collections.deque[int] = collections.deque([0] * 3, maxlen=3)
        self._running = False
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # requests sent, calls, the push socket
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stats: dict[str, Any] = {}
        self._kv_events: collections.deque = collections.deque()
        self._last_heard = 0.0  # monotonic time of the core's latest message
        self._step_s = 0.0  # the running step's age, as of the latest heartbeat
        self._dir = tempfile.TemporaryDirectory(prefix="loraplex-core-")
        self._incarnation = 0
        self._enc = wire.encoder()
        self._dec = wire.client_decoder()
        self._ctx: Any = None
        self._push: Any = None
        self._pull: Any = None
        self._proc: Any = None
        self._crumb: Path | None = None  # the current core's breadcrumb file (local cores)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> wire.CoreInfo:
        """Start the first core and wait until it is ready; then the reader thread.

        Raises:
            RuntimeError: the core exited (a bad model directory, say) or timed out.
        """
        import zmq

        self._ctx = zmq.Context()
        self.info = self._spawn()
        self._running = True
        self._thread = threading.Thread(target=self._read, name="loraplex-core-reader", daemon=True)
        self._thread.start()
        return self.info

    def _spawn(self) -> wire.CoreInfo:
        """A new core (process or actor) and sockets; block until its ``Ready``."""
        import zmq

        self._incarnation += 1
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._push = self._ctx.socket(zmq.PUSH)
        # No high-water mark: a send never blocks the gateway's event loop, even while a frozen
        # core reads nothing (until the dead timeout kills it). What queues is bounded by the
        # gateway's admission control, and the requests are held here anyway.
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        if self.launcher.remote:  # a core on another node: TCP to this host's address
            host = self.launcher.node_address()
            in_addr = f"tcp://{host}:{self._push.bind_to_random_port(f'tcp://{host}')}"
            out_addr = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        else:
            base = Path(self._dir.name)
            in_addr = f"ipc://{base}/in-{self._incarnation}"
            out_addr = f"ipc://{base}/out-{self._incarnation}"
            self._push.bind(in_addr)
            self._pull.bind(out_addr)
        self._crumb = None
        if not self.launcher.remote:
            self._crumb = breadcrumb.create(Path(self._dir.name) / f"crumb-{self._incarnation}")
        self._proc = self.launcher.launch(
            self.config,
            self.store_root,
            in_addr,
            out_addr,
            breadcrumb=None if self._crumb is None else str(self._crumb),
        )
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._proc.sentinel is not None:
            poller.register(self._proc.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            events = dict(poller.poll(200))
            if self._pull in events:
                msg = self._dec.decode(self._pull.recv())
                if isinstance(msg, wire.Ready):
                    self._last_heard, self._step_s = time.monotonic(), 0.0
                    return msg.info
            if self._proc.sentinel in events or not self._proc.is_alive():
                self._proc.join(1)
                raise RuntimeError(
                    f"the engine core exited with status {self._proc.exitcode} before it was "
                    "ready (its error is in the log above)"
                )
            if self._stopping.is_set():
                raise RuntimeError("shut down while the engine core was starting")
        self._proc.kill()
        raise RuntimeError(f"the engine core was not ready within {READY_TIMEOUT_S:.0f} s")

    def set_sink(self, sink: OutputSink) -> None:
        """See :class:`EngineCoreClient` (before the first request)."""
        self._sink = sink

    @property
    def is_running(self) -> bool:
        """True while a core is up and answering.

        Answering: heard from within the config's ``unresponsive_timeout_s``. False while one
        is silent or restarts, and after.
        """
        return (
            self._running
            and not self._stopping.is_set()
            and time.monotonic() - self._last_heard < self.config.unresponsive_timeout_s
        )

    @property
    def recovering(self) -> bool:
        """True while the core is silent or a dead one is being replaced (wait, not exit)."""
        return not self.is_running and not self.failed and not self._stopping.is_set()

    @property
    def pid(self) -> int | None:
        """The current core process's id."""
        return None if self._proc is None else self._proc.pid

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the core and the reader."""
        self._stopping.set()
        with self._lock:
            if self._push is not None and self._running:
                try:
                    self._push.send(self._enc.encode(wire.Shutdown()), _NOBLOCK)
                except Exception:  # noqa: BLE001 - best effort; the process is killed below
                    pass
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(1)
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._running = False
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._dir.cleanup()

    # --------------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest, block_hashes: Sequence[bytes] = ()) -> None:
        """Send a request to the core; its outputs come to the sink.

        Raises:
            EngineDeadError: no core is running.
            QueryOfDeathError: the request (its content) was in flight at repeated core
                deaths (a ValueError).
            TenantThrottledError: the tenant's requests keep being in flight at core deaths.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        digest = request_digest(request)
        try:
            self.quarantine.check(digest, request.tenant)
        except (ValueError, RuntimeError):
            self.quarantine_refusals += 1
            raise
        rid = request.request_id
        with self._lock:
            seq = self._seq + 1
            # an unencodable request leaves no trace
            frame = self._enc.encode(wire.AddRequest(request, seq))
            if not self._running:  # the core died since the check above
                raise EngineDeadError("the engine is not running")
            if not self._push_now(frame):
                raise EngineDeadError("the engine is not running")
            self._seq = seq
            self._sent[rid] = (digest, request.tenant, seq)

    def release(self, request_id: str) -> None:
        """The request ended: no longer a suspect of a death."""
        with self._lock:
            self._sent.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request in the core."""
        with self._lock:
            self._send(wire.Abort(request_id))

    def finish_requests(self, finishes: list[FinishRequest]) -> None:
        """See :class:`EngineCoreClient`."""
        with self._lock:
            for f in finishes:
                self._send(f)

    async def add_lora(self, adapter: Any) -> None:
        """Load an adapter of the store into the core's CPU tier (later requests find it).

        ``adapter``: a ``LoraAdapter`` or its digest; the core reads it from the store.

        Raises:
            RuntimeError: the core could not load it (the message says why).
            EngineDeadError: no core is running.
        """
        await self._call("add_lora", adapter if isinstance(adapter, str) else adapter.digest)

    async def remove_lora(self, digest: str) -> bool:
        """Drop an adapter from the core; False while a running request uses it."""
        return bool(await self._call("remove_lora", digest))

    async def _call(self, method: str, digest: str) -> Any:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
            self._send(wire.Call(call_id, method, digest))
        return await future

    def stats(self) -> dict[str, Any]:
        """The core's statistics after its latest step (refreshed at least every 0.25 s).

        With this client's own ``engine_core_deaths`` and ``quarantine_refusals``.
        """
        return {
            **self._stats,
            "engine_core_deaths": self.deaths,
            "quarantine_refusals": self.quarantine_refusals,
        }

    def drain_kv_events(self) -> list[Any]:
        """The core's KV events received since the last call, oldest first.

        See ``engine.kv_cache.events``; none unless the config has ``enable_kv_events``.
        """
        events = []
        while self._kv_events:
            events.append(self._kv_events.popleft())
        return events

    def _send(self, msg: Any) -> None:
        """Push a message to the core (caller holds ``_lock``); dropped while none runs."""
        if self._running:
            self._push_now(self._enc.encode(msg))

    def _push_now(self, frame: bytes) -> bool:
        """Push a frame without blocking (caller holds ``_lock``); False when no core takes it.

        The socket has no high-water mark, so a send only fails when the core's end is gone:
        a core that just died, before the reader marks it so. A blocking send would then wait
        for a peer that never comes, holding the lock the reader needs to handle the death.
        """
        import zmq

        if self._push is None:
            return False
        try:
            self._push.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    # ----------------------------------------------------------------- reader thread
    def _read(self) -> None:
        import zmq

        while not self._stopping.is_set():
            poller = zmq.Poller()
            poller.register(self._pull, zmq.POLLIN)
            sentinel = self._proc.sentinel  # None for a Ray actor: polled with is_alive()
            if sentinel is not None:
                poller.register(sentinel, zmq.POLLIN)
            while not self._stopping.is_set():
                events = dict(poller.poll(100))
                if self._pull in events:
                    self._drain()
                if sentinel in events if sentinel is not None else not self._proc.is_alive():
                    break
                if self._hung():
                    self._proc.kill()
                    break
            if self._stopping.is_set():
                return
            self._on_death()
            if not self._restart():
                return

    def _drain(self) -> None:
        import zmq

        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._dec.decode(frame)
            self._last_heard = time.monotonic()
            if isinstance(msg, wire.Heartbeat):
                self._step_s = msg.step_s
            elif isinstance(msg, wire.Outputs):
                self._taken.append(msg.taken)
                self._stats = msg.stats
                if msg.events:
                    self._kv_events.extend(msg.events)  # a deque: safe across threads
                if msg.outputs:
                    self._sink.on_outputs(msg.outputs)
            elif isinstance(msg, wire.Rejected):
                self._sink.on_error(msg.request_id, rejection_error(msg.message, msg.kind))
            elif isinstance(msg, wire.CallResult):
                with self._lock:
                    target = self._calls.pop(msg.call_id, None)
                if target is not None:
                    error = None if msg.error is None else RuntimeError(msg.error)
                    target[0].call_soon_threadsafe(settle, target[1], msg.value, error)

    def _fail_all(self, error: EngineDeadError) -> None:
        """End every request (the sink's ``on_dead``) and call with ``error``."""
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        if self._sink is not None:
            self._sink.on_dead(error)
        for loop, future in calls:
            try:
                loop.call_soon_threadsafe(settle, future, None, error)
            except RuntimeError:
                pass

    def _hung(self) -> bool:
        """Whether the core is alive but no longer serving (logged).

        Silent for the config's ``dead_timeout_s``, or in one step longer than
        ``step_timeout_s``.
        """
        silent = time.monotonic() - self._last_heard
        if silent >= self.config.dead_timeout_s:
            logger.error(
                "the engine core (pid %s) sent nothing for %.1f s; killing it",
                self._proc.pid,
                silent,
            )
            return True
        if self._step_s >= self.config.step_timeout_s:
            logger.error(
                "the engine core (pid %s) has been in one step for %.0f s; killing it",
                self._proc.pid,
                self._step_s,
            )
            return True
        return False

    def _on_death(self) -> None:
        with self._lock:
            self._running = False
            suspects = self._suspects()
            culprits = self._culprits()
            self._sent.clear()
        self._proc.join(1)
        logger.error(
            "the engine core (pid %s) died with status %s; failing its requests and restarting it",
            self._proc.pid,
            self._proc.exitcode,
        )
        self._fail_all(EngineDeadError("the engine core died; retry the request"))  # first
        self.deaths += 1
        key = self.quarantine.record_death(suspects, culprits)
        self._deaths.append((time.monotonic(), key))

    def _culprits(self) -> list[Suspect]:
        """The requests the dead core's breadcrumb names (caller holds ``_lock``)."""
        if self._crumb is None:
            return []
        named = breadcrumb.read(self._crumb)
        return [Suspect(*self._sent[rid][:2]) for rid in named if rid in self._sent]

    def _suspects(self) -> list[Suspect]:
        """The requests a death is blamed on (caller holds ``_lock``; ``engine.client.quarantine``).

        Those the core had not taken by the third-latest ``Outputs`` (it took them in its last
        two loops, or not yet: a request that kills it at admission or in its first step is
        among them), else every request in flight; the newest first. "Taken" is the core's own
        count (``Outputs.taken``), not when the message arrived: a reader thread that falls
        behind would otherwise read old outputs as new and let the request that just killed
        the core look old (it shared its blame with a bystander's stream and needed a third
        death to be quarantined).
        """
        since = self._taken[0]
        newest = sorted(self._sent.values(), key=lambda sent: -sent[2])
        fresh = [(d, t) for d, t, seq in newest if seq > since]
        chosen = fresh or [(d, t) for d, t, _ in newest]
        return [Suspect(d, t) for d, t in chosen]

    def _restart(self) -> bool:
        """Start a new core with back-off; False when giving up (or shutting down).

        Only deaths not explained by a quarantined request count towards giving up and the
        back-off: a query of death is refused from now on, so it cannot keep killing cores.
        """
        now = time.monotonic()
        self._deaths = [(t, k) for t, k in self._deaths if now - t < RESTART_WINDOW_S]
        unexplained = [t for t, k in self._deaths if not self.quarantine.explained(k)]
        if len(unexplained) > MAX_RESTARTS:
            self.failed = True
            logger.critical(
                "the engine core died %d times within %.0f s; giving up (the server stays "
                "unhealthy until restarted)",
                len(unexplained),
                RESTART_WINDOW_S,
            )
            return False
        delay = min(8.0, 0.5 * 2 ** max(0, len(unexplained) - 1))
        if self._stopping.wait(delay):
            return False
        try:
            self.info = self._spawn()
        except RuntimeError:
            logger.exception("restarting the engine core failed")
            self._deaths.append((time.monotonic(), ""))  # a failed start counts as a death
            return self._restart()
        self.restarts += 1
        with self._lock:
            self._running = True
        logger.warning("the engine core is back (pid %s)", self._proc.pid)
        return True
