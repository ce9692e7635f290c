"""ldt.schedule: IR round-trips, the deadlock grid, broken schedules, 1F1B timing, exports.

Pure Python, no processes except one interpreter start to prove the package does not import torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from ldt.schedule import (
    Action,
    Op,
    ScheduleError,
    check_schedule,
    format_grid,
    from_csv,
    lower,
    one_f_one_b,
    parse_action,
    simulate,
    to_chrome_trace,
    to_csv,
    to_png,
    u_shape,
)

GENERATORS = {"1f1b": one_f_one_b, "ushape": u_shape}


def unit_cost(action: Action) -> int:
    return 1


# --- IR ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["0FS3", "1F0", "4B12", "0BE0", "0SEND_F3>1", "2RECV_B1<3",
                                  "1WAIT_F0<0", "3SEND_B7>2"])
def test_action_string_round_trip(text: str) -> None:
    assert str(parse_action(text)) == text
    assert parse_action(text) == Action.parse(text)


def test_action_fields_and_channel() -> None:
    action = parse_action("0SEND_F3>1")
    assert action == Action(0, Op.SEND_F, 3, 1)
    assert action.channel == (0, 1, "F")
    assert parse_action("2RECV_B1<3").channel == (3, 2, "B")
    assert parse_action("1F0").channel is None


@pytest.mark.parametrize("bad", ["", "F0", "0X1", "0SEND_F3<1", "0F3>1", "0RECV_B1"])
def test_action_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action"):
        parse_action(bad)


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_csv_round_trip(kind: str) -> None:
    schedule = lower(GENERATORS[kind](4, 7), kind)
    assert from_csv(to_csv(schedule)) == schedule


def test_format_grid_marks_and_context() -> None:
    schedule = lower(one_f_one_b(3, 4), "1f1b")
    grid = format_grid(schedule, mark=(1, 2))
    assert grid.splitlines()[0].split() == ["step", "stage", "0", "stage", "1", "stage", "2"]
    assert f">>{schedule[1][2]}<<" in grid
    short = format_grid(schedule, mark=[(0, 10), (2, 11)], context=1)
    assert "earlier steps" in short and "later steps" in short
    assert f">>{schedule[0][10]}<<" in short and f">>{schedule[2][11]}<<" in short


def test_package_does_not_import_torch() -> None:
    code = "import sys, ldt.schedule; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the deadlock grid ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", range(2, 9))
@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_lowered_schedules_pass_the_checker(kind: str, num_stages: int) -> None:
    for m in range(1, 3 * num_stages + 1):
        check_schedule(lower(GENERATORS[kind](num_stages, m), kind))


@pytest.mark.parametrize("ratio", [Fraction(1, 2), Fraction(3, 2), Fraction(3)])
def test_u_shape_any_backward_ratio_is_deadlock_free(ratio: Fraction) -> None:
    for p in range(2, 7):
        for m in range(1, 2 * p + 3):
            check_schedule(lower(u_shape(p, m, backward_ratio=ratio), "ushape"))


def test_lowering_rules() -> None:
    """SEND right after its producer, WAIT right before its consumer, one RECV per channel open."""
    schedule = lower(u_shape(3, 5), "ushape")
    for actions in schedule.values():
        for i, action in enumerate(actions):
            if action.op in (Op.SEND_F, Op.SEND_B):
                assert actions[i - 1].is_compute and actions[i - 1].mb == action.mb
            if action.op in (Op.WAIT_F, Op.WAIT_B):
                nxt = next(a for a in actions[i + 1:] if a.is_compute)
                assert nxt.mb == action.mb
                assert all(not a.op.value.startswith("WAIT") for a in actions[i + 1:actions.index(nxt)])
        open_recvs: dict[object, int] = {}
        for action in actions:
            if action.op in (Op.RECV_F, Op.RECV_B):
                open_recvs[action.channel] = open_recvs.get(action.channel, 0) + 1
                assert open_recvs[action.channel] == 1, f"two receives open on {action.channel}"
            if action.op in (Op.WAIT_F, Op.WAIT_B):
                open_recvs[action.channel] -= 1


# --- broken schedules are caught ----------------------------------------------------------------


def _move(actions: list[Action], text: str, to: int) -> None:
    actions.insert(to, actions.pop(actions.index(parse_action(text))))


def test_cross_waiting_stages_deadlock_is_reported() -> None:
    schedule = lower(one_f_one_b(2, 2), "1f1b")
    _move(schedule[0], "0WAIT_B0<1", 2)  # stage 0 now waits for a gradient before sending anything
    with pytest.raises(ScheduleError) as info:
        check_schedule(schedule)
    message = str(info.value)
    assert "deadlock: stage 0 stuck at action #2 0WAIT_B0<1" in message
    assert "deadlock: stage 1 stuck at action #1 1WAIT_F0<0" in message
    assert ">>0WAIT_B0<1<<" in message and ">>1WAIT_F0<0<<" in message


def test_u_shape_deadlock_is_reported() -> None:
    schedule = lower(u_shape(3, 4), "ushape")
    # the edge waits for micro-batch 0's activation from the last cloud stage before sending it out
    _move(schedule[0], "0WAIT_F0<2", 0)
    schedule[0].remove(parse_action("0RECV_F0<2"))
    schedule[0].insert(0, parse_action("0RECV_F0<2"))
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 stuck at action #1 0WAIT_F0<2"):
        check_schedule(schedule)


def test_dropped_send_is_reported() -> None:
    schedule = lower(u_shape(3, 4), "ushape")
    schedule[0].remove(parse_action("0SEND_F2>1"))
    with pytest.raises(ScheduleError, match=r"stage 1 would be stuck at action #\d+ 1WAIT_F2<0"):
        check_schedule(schedule)


def test_dropped_last_send_is_reported() -> None:
    schedule = lower(one_f_one_b(3, 3), "1f1b")
    schedule[1].remove(parse_action("1SEND_F2>2"))
    with pytest.raises(ScheduleError, match=r"stage 2 would be stuck at action #\d+ 2WAIT_F2<1 .*"
                                            r"because stage 1 never sends it"):
        check_schedule(schedule)


@pytest.mark.parametrize(("edit", "pattern"), [
    (lambda s: s[1].remove(parse_action("1B0")), "never runs 1B0"),
    (lambda s: _move(s[1], "1B0", 0), "runs 1B0 at #0 before 1F0"),
    (lambda s: s[0].remove(parse_action("0RECV_B0<1")), "waits for a receive it never posted"),
    (lambda s: s[1].remove(parse_action("1WAIT_F1<0")), "posted but never waited"),
    (lambda s: s[0].append(Action(0, Op.FS, 0)), "mixes plain ops"),
])
def test_structural_errors_are_named(edit, pattern: str) -> None:
    schedule = lower(one_f_one_b(2, 2), "1f1b")
    edit(schedule)
    with pytest.raises(ScheduleError, match=pattern):
        check_schedule(schedule)


# --- timing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_1f1b_uniform_bubble_is_exact(num_stages: int) -> None:
    for m in range(1, 4 * num_stages + 1):
        result = simulate(lower(one_f_one_b(num_stages, m), "1f1b"), unit_cost)
        assert result.iteration_time == 2 * (m + num_stages - 1)
        assert Fraction(result.bubble_fraction) == Fraction(num_stages - 1, m + num_stages - 1)
        assert result.peak_inflight == {s: min(num_stages - s, m) for s in range(num_stages)}


def test_simulate_comm_time_delays_waits() -> None:
    result = simulate(lower(one_f_one_b(2, 1), "1f1b"), unit_cost, comm_time=lambda a: 10)
    assert result.iteration_time == 1 + 10 + 2 + 10 + 1


def test_simulate_local_time_and_start_offsets() -> None:
    # Hand play, F = B = 1, RECV posts in 2, SEND in 1, a WAIT takes 3 after its message is there:
    # stage 0: RECV_B [0,2], F [2,3], SEND_F [3,4] (leaves at 3), WAIT_B from 4 ...
    # stage 1 starts at 5: RECV_F [5,7], WAIT_F max(7, 3) + 3 = 10, F [10,11], B [11,12],
    #   SEND_B [12,13] (leaves at 12); stage 0: WAIT_B max(4, 12) + 3 = 15, B [15,16].
    local = {Op.RECV_B: 2, Op.RECV_F: 2, Op.SEND_F: 1, Op.SEND_B: 1, Op.WAIT_F: 3, Op.WAIT_B: 3}
    result = simulate(lower(one_f_one_b(2, 1), "1f1b"), unit_cost,
                      local_time=lambda a: local[a.op], start_at={1: 5})
    assert result.iteration_time == 16
    assert result.busy == {0: 2, 1: 2}  # communication is not busy time


# --- exports -------------------------------------------------------------------------------------


def test_chrome_trace_and_png(tmp_path) -> None:
    schedule = lower(u_shape(3, 6), "ushape")
    result = simulate(schedule, unit_cost)
    trace = tmp_path / "trace.json"
    to_chrome_trace(result, trace)
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(a.is_compute for actions in schedule.values() for a in actions)
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in complete)
    png = tmp_path / "timeline.png"
    to_png(result, png, "U-shape P=3 m=6")
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_handshake_models_a_rendezvous_transport() -> None:
    """gloo sends a message only once the receive's "ready" notice has reached the sender: a
    receive posted late (stage 1 starts at 10) costs a round trip from the post (10 + 1 + 1)
    instead of the eager arrival (sent at 0, arrived at 1, waited at 10)."""
    schedule = {0: [parse_action("0F0"), parse_action("0SEND_F0>1")],
                1: [parse_action("1RECV_F0<0"), parse_action("1WAIT_F0<0"), parse_action("1F0")]}
    kwargs = dict(duration=lambda a: 1 if a.stage == 1 else 0, comm_time=lambda a: 1,
                  start_at={1: 10})
    assert simulate(schedule, **kwargs).iteration_time == 11
    assert simulate(schedule, handshake=lambda a: 1, **kwargs).iteration_time == 13
    assert simulate(schedule, start_at={1: 0}, duration=kwargs["duration"], comm_time=lambda a: 1,
                    handshake=lambda a: 1).iteration_time == 3  # posted with the send: 2 hops
