"""--cpu-threads-bind (engine.core.cpu_bind): CPU lists parsed as the kernel writes them, auto
computed from a machine's topology, engines bound to what they were given."""

import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplex.engine.config import EngineConfig
from loraplex.engine.core.cpu_bind import (
    CpuTopology,
    allowed_cpus,
    auto_cpu_lists,
    bind_process,
    check_allowed,
    check_bind,
    engine_config_for,
    engine_cpus,
    format_cpu_list,
    normalize_bind,
    parse_bind,
    parse_cpu_list,
    physical_cores,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", (0,)),
        ("0-3", (0, 1, 2, 3)),
        ("0,2,4-7", (0, 2, 4, 5, 6, 7)),
        ("7,0-1", (0, 1, 7)),
        (" 1 , 3-3 ", (1, 3)),
    ],
)
def test_cpu_lists_read_as_the_kernel_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("0,", "not a CPU number"),
        ("a", "not a CPU number"),
        ("-1", "not a CPU number"),
        ("0-", "not a CPU number"),
        ("1-2-3", "not a CPU number"),
        ("0x1", "not a CPU number"),
        ("3-1", "ends below its start"),
        ("0-70000", "above 65535"),
        ("0-2,2", "names a CPU twice"),
    ],
)
def test_malformed_cpu_lists_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_cpu_list(text)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_survives_formatting_and_parsing(cpus):
    text = format_cpu_list(cpus)
    assert parse_cpu_list(text) == tuple(sorted(cpus))
    assert format_cpu_list(parse_cpu_list(text)) == text
    parts = text.split(",")  # ranges never touch: 0-2,3 would have been 0-3
    gaps = zip(parts, parts[1:], strict=False)
    assert all(int(b.split("-")[0]) > int(a.split("-")[-1]) + 1 for a, b in gaps)


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 5)), min_size=1), st.randoms())
def test_any_order_of_parts_reads_the_same(ranges, rnd):
    cpus: set[int] = set()
    parts = []
    for lo, width in ranges:
        span = set(range(lo, lo + width + 1))
        if span & cpus:
            continue
        cpus |= span
        parts.append(f"{lo}-{lo + width}" if width else str(lo))
    rnd.shuffle(parts)
    assert parse_cpu_list(",".join(parts)) == tuple(sorted(cpus))


def test_bind_values():
    assert parse_bind("auto") == "auto"
    assert parse_bind(" nobind ") == "nobind"
    assert parse_bind("0-1|2,3") == ((0, 1), (2, 3))
    assert normalize_bind("3,0-2 | 5") == "0-3|5"
    with pytest.raises(ValueError, match="empty"):
        parse_bind("0-1|")
    with pytest.raises(ValueError, match="not a CPU number"):
        parse_bind("Auto")


def test_cpus_outside_this_process_are_refused():
    check_allowed([(0, 1)], allowed={0, 1, 2})
    with pytest.raises(ValueError, match=r"CPUs 3,5-6 are not among .*\(0-2\)"):
        check_allowed([(0, 3), (5, 6)], allowed={0, 1, 2})


def _smt_two_nodes() -> CpuTopology:
    """8 logical CPUs: cores (0,4) (1,5) on node 0, (2,6) (3,7) on node 1."""
    core = {c: (c % 4, c % 4 + 4) for c in range(8)}
    return CpuTopology(node={c: 0 if c % 4 < 2 else 1 for c in range(8)}, core=core)


def test_topology_read_from_sysfs(tmp_path):
    for cpu in range(4):
        topo = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(f"{cpu % 2},{cpu % 2 + 2}\n")
    for n, cpus in enumerate(["0,2", "1,3"]):
        (tmp_path / "node" / f"node{n}").mkdir(parents=True)
        (tmp_path / "node" / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "node" / "node7").mkdir()  # a memory-only node: no cpulist
    topo = CpuTopology.read(tmp_path)
    assert topo.node == {0: 0, 2: 0, 1: 1, 3: 1}
    assert topo.core == {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    assert CpuTopology.read(tmp_path / "absent") == CpuTopology()


def test_auto_takes_one_cpu_per_core_and_a_node_per_replica():
    topo = _smt_two_nodes()
    assert physical_cores(range(8), topo) == [0, 1, 2, 3]
    assert physical_cores({4, 5, 6, 7}, topo) == [4, 5, 6, 7]  # siblings when alone allowed
    assert auto_cpu_lists(1, range(8), topo) == [(0, 1)]  # one engine: the first node
    assert auto_cpu_lists(2, range(8), topo) == [(0, 1), (2, 3)]
    assert auto_cpu_lists(3, range(8), topo) == [(0, 1), (2,), (3,)]  # more replicas than nodes
    assert auto_cpu_lists(4, range(8), topo) == [(0,), (1,), (2,), (3,)]
    assert auto_cpu_lists(5, range(8), topo) is None  # fewer cores than replicas
    assert auto_cpu_lists(2, {2, 3, 6, 7}, topo) == [(2,), (3,)]  # one node allowed
    flat = CpuTopology()  # no sysfs: one node, every CPU a core
    assert auto_cpu_lists(2, range(5), flat) == [(0, 1, 2), (3, 4)]
    with pytest.raises(ValueError, match="at least 1"):
        auto_cpu_lists(0, range(8), flat)


def test_each_replica_gets_its_own_list_and_the_count_must_match():
    topo = _smt_two_nodes()
    allowed = set(range(8))
    assert engine_cpus("nobind", 2, 0, allowed=allowed, topology=topo) is None
    assert engine_cpus("auto", 2, 1, allowed=allowed, topology=topo) == (2, 3)
    assert engine_cpus("0-3|4-7", 2, 1, allowed=allowed, topology=topo) == (4, 5, 6, 7)
    with pytest.raises(ValueError, match="2 CPU lists for 1 engine: give one list per replica"):
        engine_cpus("0-3|4-7", 1, 0, allowed=allowed)
    with pytest.raises(ValueError, match="1 CPU list for 3 engine replicas"):
        engine_cpus("0-3", 3, 0, allowed=allowed)
    with pytest.raises(ValueError, match="CPUs 8 are not among"):
        engine_cpus("0|8", 2, 0, allowed=allowed)


def test_check_bind_refuses_lists_for_engines_that_are_not_processes_here():
    mine = format_cpu_list(allowed_cpus())
    check_bind("auto", 4, in_process=True, remote=False)
    check_bind("nobind", 4, in_process=False, remote=True)
    check_bind(mine, 1, in_process=True, remote=False)  # one engine here: this process bound
    check_bind(f"{mine}|{mine}", 2, in_process=False, remote=False)
    with pytest.raises(ValueError, match="with --ray-address, or --replicas and --no-engine"):
        check_bind(f"{mine}|{mine}", 2, in_process=True, remote=False)
    with pytest.raises(ValueError, match="with --ray-address"):
        check_bind(mine, 1, in_process=False, remote=True)  # not quietly dropped
    with pytest.raises(ValueError, match="are not among"):
        check_bind("65535", 1, in_process=False, remote=False)


def test_replica_configs():
    config = EngineConfig(model="m")
    assert config.cpu_threads_bind == "auto"
    cpus = sorted(allowed_cpus())
    one = engine_config_for(config, 1, 0)
    assert parse_cpu_list(one.cpu_threads_bind)[0] == cpus[0]
    assert engine_config_for(config.replace(device="cuda"), 1, 0).cpu_threads_bind == "nobind"
    many = engine_config_for(config, len(cpus) + 1, 0)  # more replicas than cores: shares
    assert many.cpu_threads_bind == "nobind" and many.num_cpu_threads == 1
    fixed = engine_config_for(config.replace(num_cpu_threads=3), len(cpus) + 1, 0)
    assert fixed.num_cpu_threads == 3
    assert engine_config_for(config.replace(cpu_threads_bind="nobind"), 1, 0) == config.replace(
        cpu_threads_bind="nobind"
    )


def test_engine_config_spells_the_binding_canonically_and_refuses_nonsense():
    assert EngineConfig(model="m", cpu_threads_bind="1,0").cpu_threads_bind == "0-1"
    with pytest.raises(ValueError, match="cpu_threads_bind: .*ends below its start"):
        EngineConfig(model="m", cpu_threads_bind="3-1")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls")
def test_binding_restricts_every_thread_of_the_process_and_later_ones():
    before = os.sched_getaffinity(0)
    target = {min(before)}
    started, stop = threading.Event(), threading.Event()
    tids: list[int] = []

    def wait():
        tids.append(threading.get_native_id())
        started.set()
        stop.wait(10)

    early = threading.Thread(target=wait)
    early.start()
    started.wait(10)
    try:
        bind_process(target)
        assert os.sched_getaffinity(0) == target
        assert os.sched_getaffinity(tids[0]) == target  # a thread made before the call
        later: list[set[int]] = []
        t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert later == [target]  # and one made after
    finally:
        stop.set()
        early.join()
        bind_process(before)
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls")
def test_an_engine_core_applies_its_list_and_thread_count():
    import torch

    from loraplex.engine.core.engine_core import apply_cpu_threads

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first = min(before)
    try:
        assert apply_cpu_threads(EngineConfig(model="m", cpu_threads_bind=str(first))) == (
            f"1 torch thread on CPUs {first}"
        )
        assert os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
        bound = EngineConfig(model="m", cpu_threads_bind=str(first), num_cpu_threads=2)
        assert apply_cpu_threads(bound) == f"2 torch threads on CPUs {first}"
        # auto is for engine core processes (run_core resolves it): in process, nothing bound
        assert apply_cpu_threads(EngineConfig(model="m")).endswith(", not bound")
        with pytest.raises(ValueError, match="2 CPU lists for 1 engine"):
            apply_cpu_threads(EngineConfig(model="m", cpu_threads_bind=f"{first}|{first}"))
    finally:
        bind_process(before)
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls")
def test_threads_are_pinned_only_one_per_cpu_and_before_torch_loads():
    import torch  # noqa: F401  (loaded: too late to pin, which is said)

    from loraplex.engine.core.cpu_bind import bind_core_process

    before = os.sched_getaffinity(0)
    first = str(min(before))
    try:
        assert bind_core_process(EngineConfig(model="m", cpu_threads_bind="nobind")) is None
        assert os.sched_getaffinity(0) == before
        # more threads than CPUs: bound, not pinned, by design (nothing to say)
        spread = EngineConfig(model="m", cpu_threads_bind=first, num_cpu_threads=2)
        assert bind_core_process(spread) is None
        assert os.sched_getaffinity(0) == {int(first)}
        bind_process(before)
        one_each = EngineConfig(model="m", cpu_threads_bind=first)
        assert "torch was loaded before the binding" in bind_core_process(one_each)
    finally:
        bind_process(before)
