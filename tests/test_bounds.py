"""Bounded before allocated (ldt/schedule/size.py): the action counts that size a schedule
are known before it is built, and a count that cannot fit is refused naming what fits.

No processes: the estimate is compared with the generators' real lists (1F1B, U-shape with and
without prefetch, per-stage DP lanes), and the refusals are checked against a stated amount of
available memory, so they do not depend on the machine.
"""

import pytest

from ldt.config import ConfigError
from ldt.schedule.size import (BYTES_PER_ACTION, BYTES_PER_TIMING, SHARE_OF_MEMORY,
                               actions_per_step, check_fits, check_schedule_size)


@pytest.mark.parametrize("kind", ["1f1b", "ushape"])
@pytest.mark.parametrize("stages", [2, 3, 5])
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_the_estimate_bounds_the_generated_lists(kind, stages, m):
    from ldt.pipeline.forward_backward import stage_schedules

    for prefetch in ((0, 2) if kind == "ushape" else (0,)):
        real = sum(len(a) for a in stage_schedules(kind, stages, m, prefetch=prefetch).values())
        bound = actions_per_step(stages, m)
        assert real <= bound
        if kind == "ushape":
            assert real == bound  # 8 P + 2 per micro-batch, exactly
        else:
            assert bound <= 2 * real  # not so loose that it refuses what fits


@pytest.mark.parametrize("stage_dp, u_shape", [((1, 2), True), ((1, 2, 4), True),
                                               ((2, 1), False), ((1, 4, 2), False)])
def test_per_stage_dp_lanes_are_bounded_too(stage_dp, u_shape):
    from ldt.schedule.vdp import vdp_schedule

    for m in (1, 4):
        real = sum(len(a) for a in vdp_schedule(stage_dp, m, u_shape).values())
        assert real <= actions_per_step(len(stage_dp), m, replicas=max(stage_dp))


def test_a_count_that_cannot_fit_is_refused_with_the_largest_that_does():
    gib = 2 ** 30
    per_mb = actions_per_step(3, 1) * BYTES_PER_ACTION * 4
    most = int(SHARE_OF_MEMORY * 8 * gib // per_mb)
    check_schedule_size("train.num_microbatches", most, 3, processes=4, available=8 * gib)
    with pytest.raises(ConfigError, match=rf"train.num_microbatches={most + 1}: .* 8 GiB "
                                          rf"available .* use at most "
                                          rf"train.num_microbatches={most}$"):
        check_schedule_size("train.num_microbatches", most + 1, 3, processes=4,
                            available=8 * gib)
    # the schedule fits, the timings kept over every step do not: train.steps is named
    with pytest.raises(ConfigError, match=r"train.steps=1000000 with "
                                          r"train.num_microbatches=8: .* use at most "
                                          r"train.steps=\d+"):
        check_schedule_size("train.num_microbatches", 8, 3, steps=10 ** 6, available=8 * gib)
    steps = int((SHARE_OF_MEMORY * 8 * gib - 8 * actions_per_step(3, 1) * BYTES_PER_ACTION)
                // (8 * actions_per_step(3, 1) * BYTES_PER_TIMING))
    check_schedule_size("train.num_microbatches", 8, 3, steps=steps, available=8 * gib)
    with pytest.raises(ConfigError, match=r"--clusters=10: the clustering would take"):
        check_fits("--clusters", 10, 10 * gib, "the clustering", unit_bytes=gib,
                   available=8 * gib)


def test_validation_refuses_a_runaway_count_in_a_second():
    """The issue's train.num_microbatches=1e9 built schedules for 54 s until MemoryError."""
    import time

    from ldt.topology.validate import validate

    cluster = {"stages": [{"name": "edge"}, {"name": "cloud", "tp": 2}, {"name": "c1"}],
               "u_shape": True}
    model = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4}
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"train.num_microbatches=1000000000: the "
                                          r"schedule's 2.6e\+10 actions"):
        validate(cluster, model, train={"num_microbatches": 10 ** 9}, check_devices=False)
    assert time.monotonic() - start < 5
