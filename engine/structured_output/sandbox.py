"""The grammar sandbox: a client's grammar is compiled in a worker process before the core does.

llguidance compiles JSON schemas and regexes in native code; a shape nobody foresaw can crash
it (a stack overflow is a SIGSEGV) or take seconds. Before the engine core compiles a spec
itself, :class:`GrammarSandbox` has a worker process (``engine.structured_output.worker``) compile
it with the same library, tokenizer and parser limits, under

* a **CPU-time limit** per grammar (the worker's own CPU seconds, read from ``/proc``, so a
  busy machine does not refuse a grammar that is merely waiting for a core; a wall-clock cap of
  :data:`WALL_FACTOR` times the limit bounds the wait however idle the worker is),
* a **memory limit** (``RLIMIT_AS`` of the worker), and a lower CPU priority (``nice``), so the
  engine's step threads win the machine's cores over a compile.

A worker that crashes, runs out of memory or CPU time costs that spec a refusal (a 400) and is
replaced; the core never sees the spec. Only a spec the worker compiled is compiled in the core:
the same deterministic compiler, on a thread with 8 times the stack the worker's job had, so a
recursion that fit there fits there. Verdicts are cached by the spec's digest, refusals too, so
a spec is vetted once; concurrent requests with one spec share one job. What is the machine's
fault and not the spec's (no CPU before the wall-clock cap, a SIGKILL from outside) is not
cached and is a 503 to retry (``Verdict.transient``). Jobs are taken from the tenants' queues
in turn (round robin), so one tenant's stream of new schemas delays no one else's by more than
one job per worker.

The workers are isolated for faults, not for confidentiality: they run as the same user, with
an environment cut down to what Python needs (no keys, no ``LORAPLEX_*``), in ``/``, and die
with the thread that started them (``PR_SET_PDEATHSIG``).

This mirrors what vLLM does for grammars in spirit (compilation off the engine's step, the
request parked in ``WAITING_FOR_FSM`` until it is ready) and goes further in isolation: vLLM
compiles in a thread of the engine process, where a native fault ends the engine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from loraplex.engine.structured_output.worker import _HEADER, frame

logger = logging.getLogger(__name__)

WALL_FACTOR = 6.0  # a job may wait this many times its CPU limit in wall time
# What a worker's environment keeps (the rest, secrets included, stays out): enough to run Python.
_ENV_KEPT = frozenset(
    {"PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "SYSTEMROOT"}
)
START_TIMEOUT_S = 120.0  # a worker indexing a 150k-token vocabulary on a loaded machine
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class SandboxLimits:
    """What one grammar may cost in the sandbox.

    Attributes:
        workers: Worker processes (jobs run in parallel up to this many).
        cpu_seconds: CPU time one grammar's compilation and first mask may take.
        memory_bytes: Address space of a worker (``RLIMIT_AS``); 0 for no limit.
        nice: How much lower the workers' CPU priority is than the engine's (``nice(2)``).
        max_cached: Verdicts kept (LRU, refusals included).
    """

    workers: int = 1
    cpu_seconds: float = 5.0
    memory_bytes: int = 2 * 1024**3
    nice: int = 10
    max_cached: int = 4096


@dataclass(frozen=True)
class Verdict:
    """What the sandbox made of a spec.

    Attributes:
        ok: The spec compiled within every limit and its grammar allows a first token.
        error: Why not (a message for the client's 400), empty when ``ok``.
        seconds: Wall time of the worker's compilation (0 for a crash or a timeout).
        transient: Not the spec's fault but the machine's (the worker got no CPU before the
            wall-clock cap, or something outside the sandbox killed it): not cached, and the
            client gets a 503 to retry, not a 400.
    """

    ok: bool
    error: str = ""
    seconds: float = 0.0
    transient: bool = False


class GrammarSandboxError(RuntimeError):
    """The sandbox cannot vet anything (its worker does not start); not the spec's fault."""


class GrammarSandboxBusyError(RuntimeError):
    """The sandbox could not judge a spec in time on a loaded machine: retry (a 503)."""


def spec_digest(kind: str, value: str) -> str:
    """The cache key of a spec: SHA-256 of its kind and text."""
    return hashlib.sha256(f"{kind}\0{value}".encode()).hexdigest()


class GrammarSandbox:
    """Vets structured-output specs in worker processes (see the module docstring).

    Args:
        tokenizer_json: A callable giving the tokenizer's ``tokenizers`` JSON (called once,
            on a sandbox thread, when the first worker starts) and
        vocab_size: the model's vocabulary size, and
        eos_token_ids: its end-of-sequence ids: what the engine's own compiler is built from.
        limits: The sandbox's limits (None: the defaults).

    Thread-safe. Threads and processes start on the first :meth:`vet`.
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        limits: SandboxLimits | None = None,
    ) -> None:
        limits = limits if limits is not None else SandboxLimits()
        if limits.workers < 1:
            raise ValueError("the grammar sandbox needs at least one worker")
        self.limits = limits
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._init: bytes | None = None
        self._init_lock = threading.Lock()  # not _cond: reading the tokenizer takes a while
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[tuple[str, str, str]]] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []
        self._closed = False
        self.stats = {"grammar_vetted": 0, "grammar_refused": 0, "grammar_worker_deaths": 0}

    # ------------------------------------------------------------------------- public
    def vet(self, kind: str, value: str, tenant: str | None = None) -> Future:
        """A future :class:`Verdict` for the spec (done at once when cached).

        Args:
            kind: The spec's kind (``StructuredOutputSpec.kind``).
            value: Its text.
            tenant: Whose queue the job waits in (None: one shared queue).

        Raises:
            RuntimeError: the sandbox was shut down.
        """
        digest = spec_digest(kind, value)
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar sandbox is shut down")
            hit = self._verdicts.get(digest)
            if hit is not None:
                self._verdicts.move_to_end(digest)
                done: Future = Future()
                done.set_result(hit)
                return done
            future = self._inflight.get(digest)
            if future is not None:
                return future
            future = Future()
            self._inflight[digest] = future
            self._queues.setdefault(tenant or "", deque()).append((digest, kind, value))
            if not self._threads:
                self._start_threads()
            self._cond.notify()
            return future

    def shutdown(self) -> None:
        """Stop the threads and kill the workers; pending vets fail with RuntimeError."""
        with self._cond:
            self._closed = True
            pending = list(self._inflight.values())
            self._inflight.clear()
            self._queues.clear()
            self._cond.notify_all()
        for worker in self._workers:
            worker.closed = True
            worker.kill()
        for thread in self._threads:
            thread.join(5)
        for future in pending:
            if not future.done():
                future.set_exception(RuntimeError("the grammar sandbox is shut down"))

    @property
    def worker_pids(self) -> list[int]:
        """The live workers' process ids (for tests and operators)."""
        return [w.pid for w in self._workers if w.pid is not None]

    # ----------------------------------------------------------------------- internals
    def _start_threads(self) -> None:
        for i in range(self.limits.workers):
            worker = _Worker(self._init_frame, self.limits)
            self._workers.append(worker)
            thread = threading.Thread(
                target=self._serve,
                args=(worker,),
                name=f"loraplex-grammar-sandbox-{i}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def _init_frame(self) -> bytes:
        with self._init_lock:
            if self._init is None:
                self._init = frame(
                    {
                        "tokenizer_json": self._tokenizer_json(),
                        "vocab_size": self._vocab_size,
                        "eos_token_ids": self._eos,
                        "memory_bytes": self.limits.memory_bytes,
                        "nice": self.limits.nice,
                    }
                )
            return self._init

    def _next_job(self) -> tuple[str, str, str] | None:
        """The next job, tenants in turn (the first queue's head, that queue sent to the back)."""
        with self._cond:
            while not self._closed and not self._queues:
                self._cond.wait()
            if self._closed:
                return None
            tenant, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            del self._queues[tenant]
            if queue:
                self._queues[tenant] = queue  # to the back: the others go first
            return job

    def _serve(self, worker: _Worker) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            digest, kind, value = job
            error: BaseException | None = None
            verdict: Verdict | None = None
            try:
                verdict = worker.vet(kind, value)
            except GrammarSandboxError as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - a bug here must fail the job, not hang it
                logger.exception("the grammar sandbox failed a job")
                error = GrammarSandboxError(f"the grammar sandbox failed: {type(exc).__name__}")
            with self._cond:
                future = self._inflight.pop(digest, None)
                if verdict is not None and not verdict.transient:
                    self._verdicts[digest] = verdict
                    while len(self._verdicts) > self.limits.max_cached:
                        self._verdicts.popitem(last=False)
                    self.stats["grammar_vetted"] += 1
                    self.stats["grammar_refused"] += int(not verdict.ok)
                self.stats["grammar_worker_deaths"] = sum(w.deaths for w in self._workers)
            if future is not None and not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(verdict)


class _Worker:
    """One worker process, started on demand and replaced after a crash or a timeout."""

    def __init__(self, init_frame: Callable[[], bytes], limits: SandboxLimits) -> None:
        self._init_frame = init_frame
        self.limits = limits
        self.proc: subprocess.Popen | None = None
        self.deaths = 0
        self.closed = False  # the sandbox shut down: start nothing more

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def _start(self) -> None:
        if self.closed:
            raise GrammarSandboxError("the grammar sandbox is shut down")
        env = {k: v for k, v in os.environ.items() if k in _ENV_KEPT or k.startswith("LC_")}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex.engine.structured_output.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd="/",
            close_fds=True,
        )
        self.proc = proc
        if self.closed:  # shut down while it started
            self.kill()
            raise GrammarSandboxError("the grammar sandbox is shut down")
        try:
            proc.stdin.write(self._init_frame())
            proc.stdin.flush()
            reply = self._reply(START_TIMEOUT_S, cpu_limit=None)
        except (OSError, _Gone, _TimedOut) as exc:
            self.kill()
            raise GrammarSandboxError(f"a grammar sandbox worker did not start ({exc})") from None
        if not isinstance(reply, dict) or not reply.get("ready"):
            self.kill()
            raise GrammarSandboxError("the grammar sandbox's worker did not start")

    def vet(self, kind: str, value: str) -> Verdict:
        """Compile one spec in the worker (started first if needed).

        Raises:
            GrammarSandboxError: the worker cannot be started.
        """
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        try:
            proc.stdin.write(frame({"kind": kind, "value": value}))
            proc.stdin.flush()
            reply = self._reply(self.limits.cpu_seconds * WALL_FACTOR, self.limits.cpu_seconds)
        except _TimedOut as exc:
            self.kill()
            self.deaths += 1
            if exc.wall:  # the machine, not the spec: no CPU came before the cap
                return Verdict(
                    False, "the grammar sandbox is overloaded; retry the request", transient=True
                )
            return Verdict(
                False,
                f"the {kind} took more than {self.limits.cpu_seconds:g} s of CPU to compile",
            )
        except (_Gone, OSError):
            try:
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            self.kill()  # closes its pipes
            self.deaths += 1
            how = _describe_exit(code)
            logger.warning("a grammar sandbox worker %s on a client's %s", how, kind)
            if code == -signal.SIGKILL or self.closed:  # not the spec: the OOM killer, a shutdown
                return Verdict(False, f"the grammar sandbox's worker was {how}", transient=True)
            return Verdict(False, f"compiling the {kind} crashed the grammar compiler ({how})")
        return Verdict(bool(reply["ok"]), str(reply.get("error", "")), float(reply["seconds"]))

    def _reply(self, wall_s: float, cpu_limit: float | None) -> Any:
        """The worker's next frame, within ``wall_s`` and ``cpu_limit`` CPU seconds.

        Raises:
            _TimedOut: a limit passed first.
            _Gone: the worker closed its stdout (it died).
        """
        from loraplex.engine.structured_output.worker import read_frame

        proc = self.proc
        fd = proc.stdout.fileno()
        start = time.monotonic()
        cpu0 = _cpu_seconds(proc.pid) if cpu_limit is not None else 0.0
        while True:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                head = proc.stdout.peek(_HEADER.size) if hasattr(proc.stdout, "peek") else b"x"
                if not head:
                    raise _Gone("end of file")
                try:
                    reply = read_frame(proc.stdout)
                except ValueError as exc:
                    raise _Gone(str(exc)) from None
                if reply is None:
                    raise _Gone("end of file")
                return reply
            if proc.poll() is not None:
                raise _Gone("exited")
            if time.monotonic() - start > wall_s:
                raise _TimedOut(f"no answer in {wall_s:g} s", wall=True)
            if cpu_limit is not None and _cpu_seconds(proc.pid) - cpu0 > cpu_limit:
                raise _TimedOut(f"more than {cpu_limit:g} CPU seconds")


class _Gone(Exception):
    pass


class _TimedOut(Exception):
    def __init__(self, message: str, wall: bool = False) -> None:
        super().__init__(message)
        self.wall = wall  # the wall-clock cap, not the CPU limit


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/<pid>/stat``; 0.0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"
