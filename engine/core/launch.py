"""Where an engine core runs: a child process of this one, or a Ray actor anywhere.

``engine.client.process.ProcessCoreClient`` talks to a core over two ZMQ sockets and watches it
for death; a launcher decides where the core's loop (``engine.core.process.run_core``) runs and
gives back a handle with ``multiprocessing.Process``'s shape (``is_alive``, ``join``,
``kill``, ``exitcode``, ``pid``, ``sentinel``), so the client's restart logic is the same:

- :class:`ProcessLauncher`: ``multiprocessing`` ``spawn`` on this machine, IPC sockets; death
  is seen through the process sentinel at once.
- :class:`RayLauncher`: a Ray actor placed by Ray with the core's resources (one GPU each on
  GPU hosts), on any node of the cluster; TCP sockets to this host's address. Death is seen
  when the actor's ``run`` task ends (Ray reports a dead actor's task as failed), polled every
  100 ms. A dead core is replaced by a new actor, which Ray places where there is room.

Ray itself is imported only by :class:`RayLauncher` (``pip install ray``; the ``ray`` extra).
"""

from __future__ import annotations

import multiprocessing
from typing import Any


class ProcessLauncher:
    """Cores as child processes of this one (``spawn``: no CUDA or thread state inherited).

    Args:
        env: Environment variables set in the child before anything else runs, e.g.
            ``{"CUDA_VISIBLE_DEVICES": "2"}`` to give each replica on a multi-GPU host its own
            GPU (CUDA reads it when first initialized, after the child starts).
    """

    remote = False

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = dict(env or {})

    def launch(
        self,
        config: Any,
        store_root: str | None,
        in_addr: str,
        out_addr: str,
        breadcrumb: str | None = None,
    ) -> Any:
        """Start ``run_core`` in a child process; its ``multiprocessing.Process``.

        ``breadcrumb``: a file made by ``engine.core.breadcrumb.create`` for the core to mark.
        """
        import os

        from loraplex.engine.core.process import BREADCRUMB_ENV, PARENT_PID_ENV

        env = {**self.env, PARENT_PID_ENV: str(os.getpid())}  # the child exits when we are gone
        if breadcrumb is not None:
            env[BREADCRUMB_ENV] = breadcrumb
        proc = multiprocessing.get_context("spawn").Process(
            target=run_core_with_env,
            args=(env, config, store_root, in_addr, out_addr),
            name="loraplex-engine-core",
            daemon=True,
        )
        proc.start()
        return proc


def run_core_with_env(env: dict[str, str], *args: Any) -> None:
    """The child's entry point: set ``env``, then ``engine.core.process.run_core(*args)``."""
    import os

    os.environ.update(env)
    from loraplex.engine.core.process import run_core

    run_core(*args)


class RayLauncher:
    """Cores as Ray actors (``ray.init(address)`` once, at the first launch).

    Args:
        address: The Ray cluster (``"auto"``, ``"ray://host:port"``, a GCS address), or
            ``"local"`` for a new local instance (tests, one machine).
        num_gpus: GPUs each core asks Ray for (1 on GPU hosts, 0 on CPU).
        num_cpus: CPUs each core asks Ray for.
    """

    remote = True

    def __init__(self, address: str = "auto", num_gpus: float = 0, num_cpus: float = 1) -> None:
        self.address = address
        self.num_gpus = num_gpus
        self.num_cpus = num_cpus
        self._actor_class: Any = None

    def _ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            if self.address == "local":
                ray.init(include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=self.address, log_to_driver=False)
        if self._actor_class is None:
            self._actor_class = ray.remote(_CoreActor)
        return ray

    def node_address(self) -> str:
        """This host's address as the cluster's nodes reach it (the gateway binds there).

        Raises:
            ConnectionError: (from Ray) the cluster at ``address`` cannot be reached.
        """
        return self._ray().util.get_node_ip_address()

    def launch(
        self,
        config: Any,
        store_root: str | None,
        in_addr: str,
        out_addr: str,
        breadcrumb: str | None = None,
    ) -> Any:
        """Create a core actor and start its loop; a handle shaped like a ``Process``.

        ``breadcrumb`` is not used: the actor may run on another machine (no shared file).

        Raises:
            ConnectionError: (from Ray) the cluster at ``address`` cannot be reached.
        """
        ray = self._ray()
        actor = self._actor_class.options(
            num_gpus=self.num_gpus, num_cpus=self.num_cpus, max_restarts=0
        ).remote()
        run = actor.run.remote(config, store_root, in_addr, out_addr)
        return RayCoreHandle(ray, actor, run)


class _CoreActor:
    """The Ray actor: its one task is the core's loop."""

    def run(self, config: Any, store_root: str | None, in_addr: str, out_addr: str) -> int:
        """Serve one engine core until shut down (``engine.core.process.run_core``); its pid."""
        import os

        from loraplex.engine.core.process import run_core

        run_core(config, store_root, in_addr, out_addr)
        return os.getpid()


class RayCoreHandle:
    """A core actor as the client watches it (``multiprocessing.Process``'s shape).

    ``sentinel`` is None: there is no file descriptor to poll, so the client polls
    :meth:`is_alive`.
    """

    sentinel = None

    def __init__(self, ray: Any, actor: Any, run: Any) -> None:
        self._ray = ray
        self.actor = actor
        self.run = run
        self.exitcode: int | None = None
        self.pid: int | None = None

    def is_alive(self) -> bool:
        """False once the actor's loop has ended (shut down, crashed, or the actor died)."""
        if self.exitcode is not None:
            return False
        done, _ = self._ray.wait([self.run], timeout=0)
        if not done:
            return True
        try:
            self.pid = self._ray.get(self.run)
            self.exitcode = 0
        except Exception:  # noqa: BLE001 - RayActorError, RayTaskError: it died
            self.exitcode = 1
        return False

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the loop to end."""
        self._ray.wait([self.run], timeout=timeout)
        self.is_alive()

    def kill(self) -> None:
        """Kill the actor (its process ends; Ray does not restart it)."""
        self._ray.kill(self.actor, no_restart=True)
        self.join(5)
