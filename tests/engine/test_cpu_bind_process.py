"""Engine core processes end up on the CPUs --cpu-threads-bind gives them: one engine on a list,
its OpenMP threads pinned one per CPU; replicas on auto each on their own cores."""

import asyncio
import os

import pytest

from loraplex.engine.config import EngineConfig
from loraplex.engine.core.cpu_bind import (
    CpuTopology,
    allowed_cpus,
    auto_cpu_lists,
    format_cpu_list,
)
from loraplex.engine.request import EngineRequest
from loraplex.engine.sampling.params import SamplingParams
from loraplex.gateway.server.build import start_engine

pytestmark = [
    pytest.mark.slow,  # starts engine core processes (seconds each)
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls"),
]


def task_masks(pid: int) -> list[frozenset[int]]:
    """The CPU mask of each thread of process ``pid``."""
    masks = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks.append(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            continue
    return masks


def generate(client, rid: str) -> None:
    """One short request through the front (torch's OpenMP pool exists afterwards)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def run():
        return [o async for o in client.generate(EngineRequest(rid, [5, 6, 7, 8], params))]

    assert asyncio.run(run())


def test_one_engine_on_a_list_has_every_thread_there_and_one_omp_thread_per_cpu(
    tiny_text_dir, tmp_path
):
    cpus = sorted(allowed_cpus())[:2]
    config = EngineConfig(
        model=tiny_text_dir, num_kv_blocks=64, cpu_threads_bind=format_cpu_list(cpus)
    )
    client = start_engine(config, tmp_path / "store", in_process=False)
    try:
        pid = client.describe()["pid"]
        generate(client, "a")
        masks = task_masks(pid)
        assert frozenset().union(*masks) == frozenset(cpus)  # nothing runs elsewhere
        n = len(cpus)
        assert client.describe()["cpu_threads"] == (
            f"{n} torch thread{'s' if n > 1 else ''} on CPUs {format_cpu_list(cpus)}"
        )
        # OpenMP thread i on CPU i: the pool's workers each on one CPU of their own
        assert {frozenset({c}) for c in cpus} <= set(masks)
    finally:
        client.shutdown()


def test_fewer_threads_than_cpus_are_bound_but_not_pinned(tiny_text_dir, tmp_path):
    cpus = sorted(allowed_cpus())[:2]
    if len(cpus) < 2:
        pytest.skip("one CPU")
    bind = format_cpu_list(cpus)
    config = EngineConfig(
        model=tiny_text_dir, num_kv_blocks=64, cpu_threads_bind=bind, num_cpu_threads=1
    )
    client = start_engine(config, tmp_path / "store", in_process=False)
    try:
        generate(client, "c")
        # the one thread goes to whichever listed CPU is free: no thread held to one CPU
        assert set(task_masks(client.describe()["pid"])) == {frozenset(cpus)}
        assert client.describe()["cpu_threads"] == f"1 torch thread on CPUs {bind}"
    finally:
        client.shutdown()


def test_replicas_on_auto_split_the_cores(tiny_text_dir, tmp_path):
    lists = auto_cpu_lists(2, allowed_cpus(), CpuTopology.read())
    if lists is None:
        pytest.skip("one core: auto leaves two replicas unbound")
    config = EngineConfig(model=tiny_text_dir, num_kv_blocks=64)
    client = start_engine(config, tmp_path / "store", in_process=False, replicas=2)
    try:
        router = client.core
        for i, (name, core) in enumerate(sorted(router.replicas.items())):
            masks = task_masks(core.info.pid)
            assert frozenset().union(*masks) == frozenset(lists[i]), name
            assert core.info.cpu_threads.endswith(f"on CPUs {format_cpu_list(lists[i])}")
    finally:
        client.shutdown()


def test_nobind_leaves_the_core_where_the_kernel_puts_it(tiny_text_dir, tmp_path):
    config = EngineConfig(model=tiny_text_dir, num_kv_blocks=64, cpu_threads_bind="nobind")
    client = start_engine(config, tmp_path / "store", in_process=False)
    try:
        pid = client.describe()["pid"]
        generate(client, "b")
        assert set(task_masks(pid)) == {frozenset(allowed_cpus())}
        assert client.describe()["cpu_threads"].endswith(", not bound")
    finally:
        client.shutdown()
