"""Which CPUs an engine core runs on: ``--cpu-threads-bind`` (docs/cli.md, docs/scale_out.md).

vLLM's CPU backend binds each worker's OpenMP threads with ``VLLM_CPU_OMP_THREADS_BIND``:
``auto`` (the cores of the worker's NUMA node, one logical CPU per physical core), ``nobind``,
or CPU lists such as ``0-3`` or ``0,2,4-7``, one per rank separated by ``|``. The same values
mean the same here, the rank being the engine replica (``serve --replicas``):

- a list: the engine core's process (every thread it has, and the threads it makes later,
  torch's OpenMP pool among them) may run on those CPUs only (``os.sched_setaffinity``), and
  torch gets one thread per listed CPU unless ``--cpu-threads`` says otherwise;
- ``auto``: lists computed here (:func:`auto_cpu_lists`) from the CPUs this process may run on
  (``os.sched_getaffinity``: a container's cpuset or ``taskset`` are respected) and the
  machine's topology (``/sys/devices/system``): one logical CPU per physical core (SMT
  siblings left out), replica ``i`` on NUMA node ``i`` when there are as many nodes as
  replicas (vLLM's rule; one engine takes the first node), else the cores split into
  contiguous equal shares. Fewer cores than replicas: no binding. ``auto`` binds engine core
  processes only: an engine on a thread of another process (``--no-engine-process``,
  ``generate``, ``LLM``) is left as ``nobind`` would leave it;
- ``nobind``: nothing is bound; torch's thread count is ``--cpu-threads``, else torch's
  default (one engine) or the CPUs split between the replicas.

In an engine core process bound to a list, with one torch thread per listed CPU (the
default), the OpenMP threads are also pinned one per CPU (:func:`bind_core_process`: thread
``i`` on the list's CPU ``i``, as vLLM pins them). Measured on the 2-core development machine
with ``bench.cpu_threads``: docs/cli.md, "CPU threads".
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AUTO = "auto"
NOBIND = "nobind"
MAX_CPU_ID = 65535  # Linux's NR_CPUS is at most 8192; this bounds a range's size
_PART = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The CPU ids of a list such as ``0-3`` or ``0,2,4-7``, ascending.

    The kernel's cpulist format (``/sys/devices/system/node/node0/cpulist``, ``taskset -c``):
    comma-separated CPU numbers and inclusive ranges ``A-B``; spaces around a part are allowed.

    Returns:
        Distinct CPU ids in ascending order, at least one.

    Raises:
        ValueError: an empty list, a part that is not a number or a range, a range whose end is
            below its start, an id above :data:`MAX_CPU_ID`, or a CPU named twice.
    """
    if not text.strip():
        raise ValueError("an empty CPU list")
    cpus: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        m = _PART.fullmatch(part)
        if m is None:
            raise ValueError(
                f"{part!r} in the CPU list {text!r} is not a CPU number or a range such as 0-3"
            )
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if hi < lo:
            raise ValueError(f"the range {part!r} in the CPU list {text!r} ends below its start")
        if hi > MAX_CPU_ID:
            raise ValueError(f"CPU {hi} in the CPU list {text!r} is above {MAX_CPU_ID}")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"the CPU list {text!r} names a CPU twice")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """CPU ids as the shortest cpulist: ``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``.

    Raises:
        ValueError: no CPU, or a negative id.
    """
    ids = sorted(set(cpus))
    if not ids or ids[0] < 0:
        raise ValueError(f"no CPU list of {ids!r}")
    parts: list[str] = []
    start = prev = ids[0]
    for cpu in [*ids[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def parse_bind(text: str) -> str | tuple[tuple[int, ...], ...]:
    """A ``--cpu-threads-bind`` value: ``"auto"``, ``"nobind"`` or one CPU list per replica.

    Returns:
        ``"auto"``, ``"nobind"``, or a tuple of CPU-id tuples (``"0-1|2-3"`` ->
        ``((0, 1), (2, 3))``).

    Raises:
        ValueError: a list that :func:`parse_cpu_list` refuses (an empty one between two
            ``|`` included).
    """
    value = text.strip()
    if value in (AUTO, NOBIND):
        return value
    return tuple(parse_cpu_list(part) for part in value.split("|"))


def normalize_bind(text: str) -> str:
    """The canonical spelling of a ``--cpu-threads-bind`` value (``" 3,0-2 "`` -> ``"0-3"``).

    Raises:
        ValueError: as :func:`parse_bind`.
    """
    parsed = parse_bind(text)
    if isinstance(parsed, str):
        return parsed
    return "|".join(format_cpu_list(cpus) for cpus in parsed)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (``os.sched_getaffinity``; every CPU where absent)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def check_allowed(lists: Sequence[Sequence[int]], allowed: Iterable[int] | None = None) -> None:
    """Refuse CPU lists naming a CPU this process may not run on.

    Raises:
        ValueError: a CPU outside ``allowed`` (default: :func:`allowed_cpus`), named with the
            allowed set.
    """
    allowed = frozenset(allowed_cpus() if allowed is None else allowed)
    outside = sorted({cpu for cpus in lists for cpu in cpus} - allowed)
    if outside:
        raise ValueError(
            f"CPUs {format_cpu_list(outside)} are not among the CPUs this process may run on "
            f"({format_cpu_list(allowed) if allowed else 'none'})"
        )


@dataclass(frozen=True)
class CpuTopology:
    """Where each logical CPU sits: its NUMA node and the physical core it shares.

    Attributes:
        node: Logical CPU -> NUMA node (CPUs missing here count as node 0).
        core: Logical CPU -> its core's SMT siblings (itself included); CPUs missing here are
            cores of their own.
    """

    node: Mapping[int, int] = field(default_factory=dict)
    core: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def read(cls, root: str | Path = "/sys/devices/system") -> CpuTopology:
        """The machine's topology, read from sysfs under ``root``.

        ``node/node*/cpulist`` and ``cpu/cpu*/topology/thread_siblings_list``; whatever is
        missing or unreadable is left out (one node, one CPU per core), as on a machine
        without ``/sys``.
        """
        root = Path(root)
        node: dict[int, int] = {}
        for path in sorted(root.glob("node/node[0-9]*/cpulist")):
            try:
                text = path.read_text().strip()
                cpus = parse_cpu_list(text) if text else ()
            except (OSError, ValueError):
                continue
            for cpu in cpus:
                node[cpu] = int(path.parent.name.removeprefix("node"))
        core: dict[int, tuple[int, ...]] = {}
        for path in root.glob("cpu/cpu[0-9]*/topology/thread_siblings_list"):
            try:
                core[int(path.parent.parent.name.removeprefix("cpu"))] = parse_cpu_list(
                    path.read_text()
                )
            except (OSError, ValueError):
                continue
        return cls(node=node, core=core)


def physical_cores(allowed: Iterable[int], topology: CpuTopology) -> list[int]:
    """One logical CPU per physical core among ``allowed``: each core's lowest allowed CPU.

    Returns:
        CPU ids, ascending by (NUMA node, id).
    """
    allowed = sorted(set(allowed))
    seen: set[tuple[int, ...]] = set()
    picked: list[int] = []
    for cpu in allowed:
        key = topology.core.get(cpu, (cpu,))
        if key not in seen:
            seen.add(key)
            picked.append(cpu)
    return sorted(picked, key=lambda c: (topology.node.get(c, 0), c))


def auto_cpu_lists(
    replicas: int, allowed: Iterable[int], topology: CpuTopology
) -> list[tuple[int, ...]] | None:
    """``auto``'s CPU list for each of ``replicas`` engines, or None where it binds nothing.

    One logical CPU per physical core of ``allowed`` (:func:`physical_cores`). With at least as
    many NUMA nodes (holding such cores) as replicas, replica ``i`` takes node ``i``'s cores
    (vLLM's rule: a replica's threads and the memory they touch first on one node; one engine
    takes the first node). Otherwise the cores, in (node, id) order, are cut into ``replicas``
    contiguous shares whose sizes differ by at most one. Fewer cores than replicas: None.

    Raises:
        ValueError: ``replicas`` below 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    cores = physical_cores(allowed, topology)
    if len(cores) < replicas:
        return None
    nodes = sorted({topology.node.get(c, 0) for c in cores})
    if len(nodes) >= replicas:
        return [tuple(c for c in cores if topology.node.get(c, 0) == n) for n in nodes[:replicas]]
    share, extra = divmod(len(cores), replicas)
    lists, start = [], 0
    for i in range(replicas):
        end = start + share + (1 if i < extra else 0)
        lists.append(tuple(sorted(cores[start:end])))
        start = end
    return lists


def engine_cpus(
    bind: str,
    replicas: int,
    index: int,
    *,
    allowed: Iterable[int] | None = None,
    topology: CpuTopology | None = None,
) -> tuple[int, ...] | None:
    """The CPUs engine ``index`` of ``replicas`` (each its own process) is bound to, or None.

    Args:
        bind: A ``--cpu-threads-bind`` value.
        replicas: Engines on this machine.
        index: This engine's place among them, from 0.
        allowed: The CPUs this process may run on (default: :func:`allowed_cpus`).
        topology: The machine's (default: :meth:`CpuTopology.read`).

    Raises:
        ValueError: a malformed ``bind``; a number of lists other than ``replicas``; a CPU
            outside ``allowed``.
    """
    parsed = parse_bind(bind)
    if parsed == NOBIND:
        return None
    allowed = allowed_cpus() if allowed is None else frozenset(allowed)
    if parsed == AUTO:
        lists = auto_cpu_lists(replicas, allowed, topology or CpuTopology.read())
        return None if lists is None else lists[index]
    assert not isinstance(parsed, str)
    check_count(parsed, replicas)
    check_allowed(parsed, allowed)
    return parsed[index]


def check_count(lists: Sequence[Sequence[int]], replicas: int) -> None:
    """Refuse a number of CPU lists other than one per engine replica.

    Raises:
        ValueError: ``len(lists) != replicas``.
    """
    if len(lists) != replicas:
        engines = "1 engine" if replicas == 1 else f"{replicas} engine replicas"
        raise ValueError(
            f"--cpu-threads-bind has {len(lists)} CPU list{'s' if len(lists) != 1 else ''} "
            f"for {engines}: give one list per replica, separated by |"
        )


def check_bind(bind: str, replicas: int, *, in_process: bool, remote: bool) -> None:
    """Refuse a ``--cpu-threads-bind`` that cannot be done for this set of engines.

    Args:
        bind: The value.
        replicas: Engines.
        in_process: The engines run on threads of this process (one engine there: a list
            binds this whole process).
        remote: Ray places the engines, on any node.

    Raises:
        ValueError: malformed; a CPU outside this process's; lists for Ray actors, or for
            several engines sharing this process; not one list per replica.
    """
    parsed = parse_bind(bind)
    if isinstance(parsed, str):
        return
    check_allowed(parsed)
    if remote or (in_process and replicas > 1):
        raise ValueError(
            "--cpu-threads-bind CPU lists bind engine core processes of this machine, one "
            "each: with --ray-address, or --replicas and --no-engine-process, use auto or nobind"
        )
    check_count(parsed, replicas)


def bind_process(cpus: Iterable[int]) -> None:
    """Restrict every thread of this process to ``cpus``; threads made later inherit it.

    ``os.sched_setaffinity`` on each task of ``/proc/self/task`` (on Linux a pid there names
    one thread), the calling thread last; a thread that ends meanwhile is skipped.

    Raises:
        OSError: the kernel refuses the set (no allowed CPU in it).
    """
    import threading

    mask = set(cpus)
    me = threading.get_native_id()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    for tid in tids:
        if tid == me:
            continue
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            continue
    os.sched_setaffinity(0, mask)


def engine_config_for(config: Any, replicas: int, index: int) -> Any:
    """The ``EngineConfig`` of engine ``index`` of ``replicas`` core processes on this machine.

    Its ``cpu_threads_bind`` is resolved to its own CPU list, or to ``nobind``.

    ``auto`` binds CPU engines only (on CUDA it is ``nobind``: the GPU's NUMA node is not
    known here). Where nothing is bound and there are several replicas, ``num_cpu_threads``
    (unless set) is this process's CPUs split between them, as many as each would get.

    Raises:
        ValueError: as :func:`engine_cpus`.
    """
    bind = config.cpu_threads_bind
    if bind == AUTO and config.device != "cpu":
        bind = NOBIND
    cpus = engine_cpus(bind, replicas, index)
    if cpus is not None:
        return config.replace(cpu_threads_bind=format_cpu_list(cpus))
    changes: dict[str, Any] = {"cpu_threads_bind": NOBIND}
    if replicas > 1 and config.num_cpu_threads is None and config.device == "cpu":
        changes["num_cpu_threads"] = max(1, len(allowed_cpus()) // replicas)
    return config.replace(**changes)


#: Set while torch loads in an engine core process bound to a list: OpenMP thread ``i`` on the
#: list's CPU ``i`` (standard OpenMP places, read by GNU and Intel OpenMP when they load).
OMP_PLACES_ENV = "OMP_PLACES"
OMP_PROC_BIND_ENV = "OMP_PROC_BIND"


def bound_within(cpus: Iterable[int]) -> bool:
    """Every thread of this process may run only on CPUs among ``cpus`` already."""
    mask = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if not os.sched_getaffinity(tid) <= mask:
                return False
        except ProcessLookupError:
            continue
    return True


def bind_core_process(config: Any) -> str | None:
    """Bind an engine core process to its CPU list, and pin torch's OpenMP threads, one per CPU.

    Called first thing in the core's process (``engine.core.process.run_core``), with
    ``cpu_threads_bind`` already one list or ``nobind``. The process's threads are restricted
    to the list (:func:`bind_process`). Then, with as many torch threads as listed CPUs (the
    default) and torch not loaded yet, torch is imported with ``OMP_PLACES`` set to one place
    per listed CPU and ``OMP_PROC_BIND=close``, so OpenMP thread ``i`` runs on the ``i``-th
    CPU and never moves (vLLM pins its threads the same way, through
    ``GOMP_CPU_AFFINITY``/``KMP_AFFINITY``); the two variables are removed again once the
    OpenMP runtime has read them, so the core's own child processes do not inherit them. With
    fewer threads than CPUs (``--cpu-threads``) they are not pinned: the kernel moves each to
    whichever listed CPU is free (a thread held to one CPU loses when another process is busy
    there: docs/cli.md); with more, they share the CPUs. Where torch was loaded before (a
    program whose main module imports it, re-imported by ``spawn``), the threads are bound to
    the list but not pinned one per CPU.

    Returns:
        None, or why the threads are not pinned one per CPU though they should be.

    Raises:
        ValueError: several lists, or a CPU this process may not run on.
        OSError: the kernel refuses the set.
    """
    import sys

    bind = config.cpu_threads_bind
    if bind in (AUTO, NOBIND):
        return None
    cpus = engine_cpus(bind, 1, 0)
    assert cpus is not None
    bind_process(cpus)
    if (config.num_cpu_threads or len(cpus)) != len(cpus):
        return None
    if "torch" in sys.modules:
        return "torch was loaded before the binding: its threads share the CPUs, not one each"
    saved = {k: os.environ.get(k) for k in (OMP_PLACES_ENV, OMP_PROC_BIND_ENV)}
    os.environ[OMP_PLACES_ENV] = ",".join(f"{{{cpu}}}" for cpu in cpus)
    os.environ[OMP_PROC_BIND_ENV] = "close"
    try:
        import torch  # noqa: F401  (the OpenMP runtime reads its settings as it loads)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return None
