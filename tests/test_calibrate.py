"""Calibration (ldt/plan/calibrate.py): from recorded action times back to simulator inputs.

A step timed by hand (HAND_STEP) is the independent check: calibration must give the costs, the
start offsets and the span worked out by hand, and predict steps it was not calibrated on. The
round trip (play a schedule with known costs through the simulator, write its events as
``action_times.csv`` rows the way ldt-train does, recover the costs) checks the many schedules
no one would time by hand. A real run's rows are checked in test_train.py.
"""

from __future__ import annotations

import re

import pytest

from ldt.plan import calibrate
from ldt.schedule import Op, lower, one_f_one_b, simulate, u_shape

COMPUTE = {Op.F: 0.004, Op.B: 0.008, Op.FS: 0.002, Op.FE: 0.005, Op.BS: 0.003, Op.BE: 0.004}
LOCAL = {Op.RECV_F: 0.0002, Op.RECV_B: 0.0003, Op.SEND_F: 0.0004, Op.SEND_B: 0.0005,
         Op.WAIT_F: 0.0011, Op.WAIT_B: 0.0007}


def _cost(action):
    scale = 1 + 0.5 * action.stage  # stages differ, so a mixed-up stage would show
    return (COMPUTE if action.is_compute else LOCAL)[action.op] * scale


def _rows(schedule, start_at, steps=3, host="node0"):
    """The rows ldt-train would write for ``steps`` identical steps of ``schedule``."""
    result = simulate(schedule, _cost, local_time=_cost, start_at=start_at)
    rows = []
    for step in range(steps):
        origin = 100.0 + step  # the host clock when the earliest stage started this step
        for e in result.events:
            offset = start_at.get(e.stage, 0.0)
            rows.append(calibrate.ActionTime(step, e.action, e.start - offset, e.end - offset,
                                             host, origin + offset))
    return result, rows


@pytest.mark.parametrize("kind, schedule", [
    ("ushape", lower(u_shape(3, 4), "ushape")),
    ("1f1b", lower(one_f_one_b(3, 4), "1f1b")),
])
def test_round_trip_recovers_costs_offsets_and_iteration_time(kind, schedule):
    start_at = {0: 0.0015, 1: 0.0, 2: 0.0006}
    played, rows = _rows(schedule, start_at)
    cal = calibrate.calibrate(rows)
    assert cal.schedule == schedule
    for (stage, op), seconds in {**cal.compute, **cal.local}.items():
        assert seconds == pytest.approx(_cost(calibrate.Action(stage, op, 0)), abs=1e-12), (stage, op)
    assert cal.start_at == pytest.approx(start_at)
    spans = calibrate.step_spans(rows)
    assert list(spans.values()) == pytest.approx([played.iteration_time] * 3)
    assert cal.predict().iteration_time == pytest.approx(played.iteration_time)
    assert cal.predict(compute_only=True).iteration_time < played.iteration_time


# One step of 1F1B on 2 stages, 1 micro-batch, timed by hand (ms; stage 1 starts 0.5 ms after
# stage 0 on the host clock). Stage 1's WAIT_F starts at 0.1 but stage 0 sends at 4.1 (clock):
# its own time is 1.0, so it returns at clock 5.1 (4.6 on stage 1's step clock); stage 0's
# WAIT_B starts at 4.3 and stage 1 sends at clock 23.1: own time 0.7, returns at 23.8.
HAND_STEP = {  # action: (start, end) on its stage's step clock
    0: [("0RECV_B0<1", 0.0, 0.1), ("0F0", 0.1, 4.1), ("0SEND_F0>1", 4.1, 4.3),
        ("0WAIT_B0<1", 4.3, 23.8), ("0B0", 23.8, 31.8)],
    1: [("1RECV_F0<0", 0.0, 0.1), ("1WAIT_F0<0", 0.1, 4.6), ("1F0", 4.6, 10.6),
        ("1B0", 10.6, 22.6), ("1SEND_B0>0", 22.6, 22.9)],
}
HAND_STARTS = {0: 0.0, 1: 0.5}
HAND_SPAN_MS = 31.8  # stage 0's B0 ends at 31.8 on the clock; stage 0 started first, at 0


def _hand_rows(step, stretch_f1=1.0):
    """HAND_STEP as action_times.csv rows of ``step`` (clock origin 100 s + step); stage 1's
    F0 lasts ``stretch_f1`` times as long (and everything after it on both stages shifts)."""
    extra = 6.0 * (stretch_f1 - 1)
    rows = []
    for stage, actions in HAND_STEP.items():
        for name, start, end in actions:
            later = extra if (stage == 1 and start >= 10.6) or (stage == 0 and start >= 23.8) else 0
            if name == "1F0":
                end += extra
            if name == "0WAIT_B0<1":
                end += extra
            rows.append(calibrate.ActionTime(step, calibrate.parse_action(name),
                                             (start + later) / 1e3, (end + later) / 1e3, "node0",
                                             100.0 + step + HAND_STARTS[stage] / 1e3))
    return rows


def test_hand_timed_step_gives_hand_computed_costs_and_span():
    """Expected values worked out by hand from HAND_STEP, not by the simulator under test."""
    rows = _hand_rows(0) + _hand_rows(1)
    assert calibrate.step_spans(rows) == pytest.approx({0: 31.8e-3, 1: 31.8e-3})
    cal = calibrate.calibrate(rows)
    assert cal.compute == pytest.approx({(0, Op.F): 4e-3, (0, Op.B): 8e-3, (1, Op.F): 6e-3,
                                         (1, Op.B): 12e-3})
    assert cal.local == pytest.approx({(0, Op.RECV_B): 0.1e-3, (0, Op.SEND_F): 0.2e-3,
                                       (0, Op.WAIT_B): 0.7e-3, (1, Op.RECV_F): 0.1e-3,
                                       (1, Op.WAIT_F): 1.0e-3, (1, Op.SEND_B): 0.3e-3})
    assert cal.start_at == pytest.approx({0: 0.0, 1: 0.5e-3})
    assert cal.predict().iteration_time == pytest.approx(HAND_SPAN_MS / 1e3)
    # compute only: F0 4, F0 6, B0 12, B0 8 one after another, messages free, same start
    assert cal.predict(compute_only=True).iteration_time == pytest.approx(30e-3)
    # the transfers as the receivers' WAITs measured them; no order of one micro-batch's
    # actions beats its path: 4 + 1.0 + 6 + 12 + 0.7 + 8 = 31.7 ms, 30 ms of it computing
    # on 2 stages
    assert cal.transfer_times() == pytest.approx({(0, 1): 1.0e-3, (1, 0): 0.7e-3})
    assert cal.least_iteration() == pytest.approx(31.7e-3)
    summary = calibrate.compare(rows).summary()
    assert summary["least_ms"] == pytest.approx(31.7)
    assert summary["bubble_least"] == pytest.approx(1 - 30 / (2 * 31.7), abs=1e-4)


def test_compare_predicts_steps_it_was_not_calibrated_on():
    """Calibrated on steps whose stage-1 forward took 5 and 7 ms (mean 6), the model predicts a
    held-out step whose forward took 6 ms: the hand-timed span, 31.8 ms; and a step whose
    forward took 9 ms is measured as 34.8 ms, so the prediction is off by -8.6%."""
    train = _hand_rows(0, 5 / 6) + _hand_rows(1, 7 / 6)
    held_out = calibrate.compare(train, measured=_hand_rows(2))
    assert held_out.steps == 1 and held_out.measured_s == pytest.approx(31.8e-3)
    assert abs(held_out.error) < 1e-9
    slow = calibrate.compare(train, measured=_hand_rows(3, 9 / 6))
    assert slow.measured_s == pytest.approx(34.8e-3)
    assert slow.error == pytest.approx(31.8 / 34.8 - 1)
    in_sample = calibrate.compare(train)  # ldt-sim --measured: the same steps
    assert in_sample.steps == 2 and in_sample.measured_s == pytest.approx(31.8e-3)


def test_a_wait_is_charged_from_when_its_message_was_sent():
    # 2 stages, m=1; stage 1 posts its RECV and WAITs long before stage 0 sends (stage 0
    # computes 0.004 first): the WAIT's own time must exclude that idle wait.
    schedule = lower(one_f_one_b(2, 1), "1f1b")
    _, rows = _rows(schedule, {})
    wait = next(r for r in rows if r.step == 0 and r.action.op is Op.WAIT_F)
    assert wait.duration_s > 0.003  # it did wait for stage 0's forward
    cal = calibrate.calibrate(rows)
    assert cal.local[(1, Op.WAIT_F)] == pytest.approx(LOCAL[Op.WAIT_F] * 1.5)


def test_means_keep_the_slow_tail():
    # One step in four has a 3x slower forward on stage 1 (a descheduled rank): the step's
    # expected cost includes it, so the table must be the mean, not the median.
    schedule = lower(one_f_one_b(2, 1), "1f1b")
    _, rows = _rows(schedule, {}, steps=4)
    slow = [r for r in rows if r.step == 0 and r.action.stage == 1 and r.action.op is Op.F]
    rows = [r if r not in slow else calibrate.ActionTime(
        r.step, r.action, r.start_s, r.start_s + 3 * r.duration_s, r.host, r.step_start_s)
        for r in rows]
    f = COMPUTE[Op.F] * 1.5
    assert calibrate.calibrate(rows).compute[(1, Op.F)] == pytest.approx(f * (3 + 3) / 4)


@pytest.mark.parametrize("edit, message", [
    (lambda r, i: calibrate.ActionTime(r.step, r.action, r.start_s, r.end_s,
                                       f"node{r.action.stage}", r.step_start_s), "hosts"),
    (lambda r, i: calibrate.ActionTime(r.step, r.action, r.start_s, r.end_s, r.host, None),
     "step starts are missing"),
])
def test_needs_one_clock(edit, message):
    _, rows = _rows(lower(one_f_one_b(2, 2), "1f1b"), {})
    with pytest.raises(ValueError, match=message) as err:
        calibrate.calibrate([edit(r, i) for i, r in enumerate(rows)])
    assert "single-host run" in str(err.value)


def test_no_rows_says_what_to_run():
    with pytest.raises(ValueError, match="train.runtime=ldt"):
        calibrate.calibrate([])


def test_ldt_sim_measured_replays_a_run_folder(tmp_path, capsys):
    import csv
    import json

    from ldt.tools.sim import main
    from ldt.training.outputs import ACTION_TIMES_KEYS

    played, rows = _rows(lower(u_shape(3, 4), "ushape"), {0: 0.001}, steps=5)
    with open(tmp_path / "action_times.csv", "w", newline="") as f:  # ldt-train's format
        w = csv.writer(f)
        w.writerow(ACTION_TIMES_KEYS)
        w.writerows((r.step, r.action.stage, str(r.action), repr(r.start_s), repr(r.end_s),
                     r.host, repr(r.step_start_s)) for r in rows)
    assert main(["--measured", str(tmp_path), "--skip", "2", "--json",  # outputs: not in
                 "--png", str(tmp_path.parent / f"{tmp_path.name}.png")]) == 0  # the run
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3
    assert summary["measured_ms"] == pytest.approx(played.iteration_time * 1e3, abs=1e-3)
    assert abs(summary["error"]) < 1e-6
    assert (tmp_path.parent / f"{tmp_path.name}.png").stat().st_size > 0
    assert main(["--measured", str(tmp_path), "--skip", "2"]) == 0  # the table: its least line
    least = re.search(r"\n  least, any order of these ops +([\d.]+) ms  bubble [\d.]+% \(least "
                      r"([\d.]+)%\)\n", capsys.readouterr().out)
    assert float(least.group(1)) == pytest.approx(summary["least_ms"], abs=0.01)
    assert float(least.group(2)) == pytest.approx(100 * summary["bubble_least"], abs=0.1)
    assert summary["least_ms"] <= summary["measured_ms"]
    assert main(["--measured", str(tmp_path / "missing")]) == 2
    assert "train.runtime=ldt" in capsys.readouterr().err


def test_steps_with_different_action_lists_are_refused():
    _, rows = _rows(lower(one_f_one_b(2, 2), "1f1b"), {}, steps=2)
    _, other = _rows(lower(one_f_one_b(2, 3), "1f1b"), {}, steps=2)
    with pytest.raises(ValueError, match="step 1 ran other action lists than step 0"):
        calibrate.calibrate([r for r in rows if r.step == 0] + [r for r in other if r.step == 1])
