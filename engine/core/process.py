"""The engine core's own process: load the model, then step while there is work.

:func:`run_core` is the entry point of the child process that ``engine.client.process`` starts. It
builds an :class:`EngineCore` (adapters read from the gateway's adapter store by digest), sends
:class:`~engine.core.wire.Ready`, then loops: drain the client's messages (a blocking poll only
while nothing is in flight), run one step, push its outputs with the core's statistics. A step
that raises ``EngineFaultError`` (or any bug in the loop) ends the process with status 1; the
client sees the process end and restarts it. Nothing here tokenizes or detokenizes: that is the
client's side.

A thread of its own sends :class:`~engine.core.wire.Heartbeat` every :data:`HEARTBEAT_EVERY_S`
on a socket of its own, with how long the current step has run: the client tells a core that is
frozen or cut off (no heartbeat) from one whose loop is stuck (heartbeats with a step that never
ends) from one that is merely busy. (Liveness kept apart from the work, as Ray's GCS checks its
nodes' health on a channel of its own rather than by their tasks' progress.)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

STATS_EVERY_S = 0.25  # statistics ride on outputs, and go alone at least this often when idle
HEARTBEAT_EVERY_S = 0.1
BREADCRUMB_ENV = "LORAPLEX_CORE_BREADCRUMB"
"""Set by ``engine.core.launch.ProcessLauncher``: the file the core marks with the request it
runs native code for (``engine.core.breadcrumb``), read by its client after a crash."""
PARENT_PID_ENV = "LORAPLEX_CORE_PARENT_PID"
"""Set by ``engine.core.launch.ProcessLauncher``: the heartbeat thread ends the core within
:data:`HEARTBEAT_EVERY_S` once that process is gone (a SIGKILLed gateway leaves no orphan core
holding memory, the model and the grammar sandbox's workers)."""
CRASH_ON_TOKENS_ENV = "LORAPLEX_TEST_CRASH_ON_TOKENS"
"""Fault injection for tests: ``admit:`` or ``step:`` and comma-separated token ids; a request
whose prompt holds them in a row kills this process with SIGSEGV when it is admitted (inside its
breadcrumb: the client knows it for certain) or before the first step that runs it (outside
any breadcrumb: the client has only its suspects), as a native fault would (the query-of-death
tests, docs/hardening.md). Unset in production."""


def run_core(config: Any, store_root: str | None, in_addr: str, out_addr: str) -> None:
    """Child process body: serve one engine core until shut down or broken.

    First this process is bound to its CPUs (``config.cpu_threads_bind``; ``auto`` resolved
    here for one engine, a replica set hands each replica its own list) and torch loaded with
    its OpenMP threads pinned to them (``engine.core.cpu_bind.bind_core_process``).

    Args:
        config: The ``EngineConfig``.
        store_root: The gateway's adapter store, a directory or an object-store URL
            (``adapters.object_store.open_store``), or None.
        in_addr: ZMQ address the client pushes messages to (this process pulls).
        out_addr: ZMQ address this process pushes messages to (the client pulls).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway handles Ctrl-C and tells us
    if config.attention_backend != "triton":
        from loraplex.engine.triton_guard import keep_triton_out

        keep_triton_out()  # before the engine's imports: no triton, no leak report at exit
    from loraplex.engine.core.cpu_bind import AUTO, bind_core_process, engine_config_for

    if config.cpu_threads_bind == AUTO:  # one engine (a replica set hands each its own list)
        config = engine_config_for(config, 1, 0)
    unpinned = bind_core_process(config)  # loads torch, its OpenMP threads pinned to the list
    import msgspec
    import zmq

    from loraplex.engine.client.core_client import core_info
    from loraplex.engine.core import wire
    from loraplex.engine.core.breadcrumb import Breadcrumb
    from loraplex.engine.core.engine_core import EngineCore

    logging.basicConfig(level=os.environ.get("LORAPLEX_CORE_LOG_LEVEL", "WARNING"))
    if unpinned is not None:
        logger.warning("--cpu-threads-bind %s: %s", config.cpu_threads_bind, unpinned)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(out_addr)
    enc, dec = wire.encoder(), wire.core_decoder()

    crumb = os.environ.get(BREADCRUMB_ENV)
    core = EngineCore(
        config,
        adapter_loader=_store_loader(store_root, lambda: core),
        breadcrumb=Breadcrumb(crumb) if crumb else None,
    )
    push.send(enc.encode(wire.Ready(core_info(core))))
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    last_stats = 0.0
    step_started = [0.0]  # monotonic start of the running step; 0.0 between steps
    stop_beating = threading.Event()
    beater = threading.Thread(
        target=_beat,
        args=(ctx, out_addr, step_started, stop_beating),
        name="loraplex-core-heartbeat",
        daemon=True,
    )
    beater.start()
    taken = 0  # the highest AddRequest seq taken: each Outputs says it
    try:
        while True:
            busy = core.has_unfinished_requests()
            if poller.poll(0 if busy else int(STATS_EVERY_S * 1000)):
                while True:
                    try:
                        frame = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = dec.decode(frame)
                    except msgspec.DecodeError:  # a client of another version: dropped
                        logger.exception("an undecodable message from the client")
                        continue
                    if isinstance(msg, wire.AddRequest):
                        taken = max(taken, msg.seq)
                    reply = _handle(core, msg)
                    if reply is _SHUTDOWN:
                        return
                    if reply is not None:
                        push.send(enc.encode(reply))
            outputs = []
            if core.has_unfinished_requests():
                step_started[0] = time.monotonic()
                _maybe_crash_in_step(core)
                outputs = core.step()
                step_started[0] = 0.0
                for rid, message, kind in core.take_rejected():  # refused grammars
                    push.send(enc.encode(wire.Rejected(rid, message, kind)))
            events = core.drain_kv_events()
            now = time.monotonic()
            if outputs or events or now - last_stats >= STATS_EVERY_S:
                push.send(enc.encode(wire.Outputs(outputs, _stats(core), events, taken)))
                last_stats = now
    finally:
        core.shutdown()
        stop_beating.set()
        beater.join()
        push.close()
        pull.close(linger=0)
        ctx.term()


def _beat(ctx: Any, out_addr: str, step_started: list[float], stop: threading.Event) -> None:
    """Send a heartbeat every :data:`HEARTBEAT_EVERY_S` on a socket of this thread's own."""
    import zmq

    from loraplex.engine.core import wire

    enc = wire.encoder()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10)  # a client that is gone must not make this queue grow
    sock.connect(out_addr)
    parent = int(os.environ.get(PARENT_PID_ENV, "0"))
    try:
        while not stop.wait(HEARTBEAT_EVERY_S):
            if parent and os.getppid() != parent:  # the gateway died without shutting us down
                logger.error("the engine core's parent (pid %d) is gone; exiting", parent)
                os._exit(1)
            started = step_started[0]
            step_s = time.monotonic() - started if started else 0.0
            try:
                sock.send(enc.encode(wire.Heartbeat(step_s)), zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        sock.close()


_SHUTDOWN = object()


def _handle(core: Any, msg: Any) -> Any:
    """Apply one client message; the reply to send, if any."""
    from loraplex.engine.core import wire
    from loraplex.engine.core.breadcrumb import STEP
    from loraplex.engine.structured_output.grammar import StructuredOutputError

    if isinstance(msg, wire.AddRequest):
        rid = msg.request.request_id
        try:
            # Admission handles this request alone: a native fault in it is this request's.
            with core.breadcrumb.on(STEP, rid):
                _maybe_crash(msg.request.prompt_token_ids, "admit")
                core.add_request(msg.request)
        except StructuredOutputError as exc:
            return wire.Rejected(rid, str(exc), "structured")
        except ValueError as exc:
            return wire.Rejected(rid, str(exc), "value")
        except Exception as exc:  # a fault admitting this request: it alone fails
            logger.exception("admitting request %s failed", rid)
            return wire.Rejected(rid, type(exc).__name__, "fault")
        return None
    if isinstance(msg, wire.Abort):
        core.abort_request(msg.request_id)
        return None
    if isinstance(msg, wire.FinishRequest):
        core.finish_request(msg.request_id, msg.reason, msg.stop_reason, msg.index)
        return None
    if isinstance(msg, wire.Call):
        try:
            if msg.method == "add_lora":
                core.add_lora(core.adapters.load(msg.digest))
                return wire.CallResult(msg.call_id, value=True)
            if msg.method == "remove_lora":
                return wire.CallResult(msg.call_id, value=core.remove_lora(msg.digest))
            return wire.CallResult(msg.call_id, error=f"unknown call {msg.method!r}")
        except Exception as exc:  # the caller gets it; the core runs on
            return wire.CallResult(msg.call_id, error=f"{type(exc).__name__}: {exc}")
    if isinstance(msg, wire.Shutdown):
        return _SHUTDOWN
    return None


def _maybe_crash(prompt: list[int], where: str) -> None:
    """Die of SIGSEGV if the prompt holds :data:`CRASH_ON_TOKENS_ENV`'s ids for ``where``."""
    marker = os.environ.get(CRASH_ON_TOKENS_ENV)
    if not marker or not marker.startswith(where + ":"):
        return
    ids = [int(t) for t in marker.split(":", 1)[1].split(",")]
    n = len(ids)
    if any(prompt[i : i + n] == ids for i in range(len(prompt) - n + 1)):
        os.kill(os.getpid(), signal.SIGSEGV)


def _maybe_crash_in_step(core: Any) -> None:
    """``step:`` fault injection: die before a step that runs a marked request (tests only).

    Outside any breadcrumb, as a fault in the batched forward pass would be.
    """
    if os.environ.get(CRASH_ON_TOKENS_ENV, "").startswith("step:"):
        for request in [s.request for s in core.scheduler.seqs.values()]:
            _maybe_crash(request.prompt_token_ids, "step")


def _stats(core: Any) -> dict[str, int | float | list[int]]:
    return {k: v for k, v in core.stats().items() if isinstance(v, int | float | list)}


def _store_loader(store_root: str | None, get_core: Any) -> Any:
    """``digest -> LoraAdapter`` read from the adapter store, validated against the model.

    An object store's downloads are kept in ``$LORAPLEX_ADAPTER_CACHE_DIR`` (default: a
    directory of this user's under the system's temporary directory, shared by the cores of
    this machine; 2 GiB, least recently used first out).
    """
    if store_root is None:
        return None
    import tempfile

    from loraplex.adapters.object_store import is_url, open_store

    cache_dir = None
    if is_url(store_root):
        cache_dir = os.environ.get("LORAPLEX_ADAPTER_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"loraplex-adapter-cache-{os.getuid()}"
        )
    store = open_store(store_root, cache_dir=cache_dir)

    def load(digest: str) -> Any:
        return store.load(digest, limits=get_core().adapter_limits)

    return load
