"""``EngineCore.step_stats``: per-step timings stay bounded in a long-running core."""

from loraplex.engine.core.engine_core import StepStats


def test_totals_count_every_step_and_the_ring_keeps_the_latest():
    stats = StepStats(recent=4)
    for i in range(10):
        stats.record(0.5 + i, 0.25)
    assert stats.num_steps == 10
    assert stats.step_seconds == sum(0.5 + i for i in range(10))
    assert stats.forward_seconds == 2.5
    assert list(stats.recent) == [(0.5 + i, 0.25) for i in range(6, 10)]
    stats.reset()
    assert (stats.num_steps, stats.step_seconds, stats.forward_seconds) == (0, 0.0, 0.0)
    assert not stats.recent
