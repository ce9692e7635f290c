"""Every report of the schedule checker (ldt/schedule/check.py), read in full.

A user with a broken schedule gets one of these messages and a step grid with the actions it
blames marked ``>>like this<<``. Each case here is a tiny schedule written by hand with the
defect in plain sight; the expected message and the set of marked actions are written out too,
so a report that names the wrong action, blames nobody, or says nothing fails.
"""

from __future__ import annotations

import re

import pytest

from ldt.schedule import ScheduleError, check_schedule, parse_action
from ldt.schedule.check import play
from ldt.schedule.ir import Action, LaneSchedule, Op


def S(**stages) -> dict:
    """``S(s0="0F0 0B0", s1="...")``: a schedule from action strings, one list per stage."""
    return {int(k[1:]): [parse_action(a) for a in v.split()] for k, v in stages.items()}


def report(schedule) -> tuple[str, list[str], str]:
    """(the message before the grid, the marked actions in grid order, the grid)."""
    with pytest.raises(ScheduleError) as info:
        check_schedule(schedule)
    message, grid = str(info.value).split("\n\n", 1)
    return message, re.findall(r">>(\S+)<<", grid), grid


# a correct 2-stage, 1-micro-batch 1F1B, the base most cases edit
GOOD = dict(s0="0RECV_B0<1 0F0 0SEND_F0>1 0WAIT_B0<1 0B0",
            s1="1RECV_F0<0 1WAIT_F0<0 1F0 1B0 1SEND_B0>0")


def test_the_base_schedule_passes_and_plays_by_hand():
    schedule = S(**GOOD)
    check_schedule(schedule)
    from ldt.schedule.check import match_messages

    # F and B take 1 and 2 on stage 0, 3 and 4 on stage 1; posting and waiting take nothing
    played = play(schedule, match_messages(schedule),
                  duration=lambda a: {(0, Op.F): 1, (0, Op.B): 2, (1, Op.F): 3, (1, Op.B): 4}[
                      (a.stage, a.op)])
    assert played.start == {0: [0, 0, 1, 1, 8], 1: [0, 0, 1, 4, 8]}
    assert played.end == {0: [0, 1, 1, 8, 10], 1: [0, 1, 4, 8, 8]}


def test_tables_play_as_the_functions_they_stand_for():
    """The planner hands play tables, (stage, op) -> duration and (stage, peer) -> wire time;
    they must time every action as the same costs given as functions do."""
    schedule = S(**GOOD)
    from ldt.schedule.check import match_messages

    compute = {(0, "F"): 1, (0, "B"): 2, (1, "F"): 3, (1, "B"): 4}
    wire = {(0, 1): 0.5, (1, 0): 0.25}
    tables = play(schedule, match_messages(schedule), duration=compute, comm_time=wire)
    functions = play(schedule, match_messages(schedule),
                     duration=lambda a: compute[(a.stage, a.op.value)],
                     comm_time=lambda a: wire[(a.stage, a.peer)])
    assert tables == functions
    assert tables.end[1][1] == 1.5 and tables.end[0][3] == 8.75  # F0 + 0.5; B1 ends 8.5, + 0.25


def test_a_rendezvous_handshake_is_per_receive():
    """play's ``handshake(recv)`` is asked about the RECV it delays: stage 1's receive of the
    activation is slow to announce (5), stage 0's receive of the gradient is not (0)."""
    schedule = S(**GOOD)
    from ldt.schedule.check import match_messages

    played = play(schedule, match_messages(schedule), duration=lambda a: 1,
                  handshake=lambda recv: 5 if recv.stage == 1 else 0)
    # stage 1 posted at 0, its notice reaches stage 0 at 5: the activation leaves then
    assert played.end[1][1] == 5  # 1WAIT_F0<0
    assert played.end[0][-1] == 8  # stage 1: F [5,6], B [6,7], send at 7; stage 0's B [7,8]


def test_an_action_in_another_stages_list():
    msg, marks, _ = report({0: [Action(1, Op.F, 0)]})
    assert msg == ("action #0 1F0 of stage 0 says it runs on stage 1; a stage's list holds only "
                   "its own actions")
    assert marks == ["1F0"]


def test_a_compute_run_twice():
    msg, marks, _ = report(S(s0="0F0 0F0 0B0"))
    assert msg == ("stage 0 runs 0F0 twice (actions #0 and #1); each micro-batch runs each "
                   "compute op once")
    assert marks == ["0F0", "0F0"]


def test_a_backward_before_its_forward():
    msg, marks, _ = report(S(s0="0B0 0F0"))
    assert msg == "stage 0 runs 0B0 at #0 before 0F0; per micro-batch the order must be F<B"
    assert marks == ["0B0"]
    msg, marks, _ = report(S(s0="0FS0 0BS0 0FE0 0BE0"))  # the edge's own order
    assert msg == ("stage 0 runs 0BS0 at #1 before 0FE0; per micro-batch the order must be "
                   "FS<FE<BS<BE")
    assert marks == ["0BS0"]


def test_a_compute_never_run_names_the_micro_batches():
    msg, marks, grid = report(S(s0="0F0 0F1 0B1"))
    assert msg == "stage 0 never runs 0B0; every micro-batch 0..1 needs it"
    assert marks == [] and grid.count("\n") == 3  # header and all three steps, nothing marked
    # an evaluation schedule (no backward anywhere) needs only the forwards
    check_schedule(S(s0="0F0 0F1"))
    msg, _, _ = report(S(s0="0F1"))
    assert msg == "stage 0 never runs 0F0; every micro-batch 0..1 needs it"


def test_plain_and_edge_ops_on_one_stage():
    msg, marks, _ = report(S(s0="0F0 0FS0"))
    assert msg == ("stage 0 mixes plain ops (<Op.F: 'F'>, <Op.B: 'B'>) and U-shape edge ops "
                   "(<Op.FS: 'FS'>, <Op.FE: 'FE'>, <Op.BS: 'BS'>, <Op.BE: 'BE'>); a stage is "
                   "either a plain stage or the edge")
    assert marks == []


def test_a_lane_runs_only_its_own_micro_batches():
    lanes = LaneSchedule(S(s0="0F0 0B0 0F1 0B1"), {0: [0]})
    msg, marks, _ = report(lanes)
    assert msg == "lane 0 runs micro-batches [1] that routing gives to other lanes (its own: [0])"
    missing = LaneSchedule(S(s0="0F0 0B0"), {0: [0, 2]})
    msg, marks, _ = report(missing)
    assert msg == "lane 0 never runs 0F2; its micro-batches [0, 2] need it"


def test_a_receive_posted_twice():
    msg, marks, _ = report(S(s0=GOOD["s0"],
                             s1="1RECV_F0<0 1RECV_F0<0 1WAIT_F0<0 1F0 1B0 1SEND_B0>0"))
    assert msg == "stage 1 posts 1RECV_F0<0 twice without waiting in between"
    assert marks == ["1RECV_F0<0", "1RECV_F0<0"]


def test_a_wait_without_its_receive():
    msg, marks, _ = report(S(s0="0F0 0SEND_F0>1 0WAIT_B0<1 0B0", s1=GOOD["s1"]))
    assert msg == ("stage 0 action #2 0WAIT_B0<1 waits for a receive it never posted; put "
                   "RECV_B for micro-batch 0 from stage 1 before it")
    assert marks == ["0WAIT_B0<1"]


def test_a_receive_never_waited():
    msg, marks, _ = report(S(s0="0RECV_B0<1 0F0 0SEND_F0>1 0B0", s1=GOOD["s1"]))
    assert msg == ("stage 0 action #0 0RECV_B0<1 is posted but never waited; add the matching "
                   "WAIT before the compute that consumes it")
    assert marks == ["0RECV_B0<1"]


def test_a_send_nobody_receives():
    """A channel with a send and no receive at all (stage 1 never posts the activation)."""
    msg, marks, _ = report(S(s0=GOOD["s0"], s1="1F0 1B0 1SEND_B0>0"))
    assert msg == ("channel 0->1 (F): stage 0 action #2 0SEND_F0>1 (message #0) is never "
                   "received by stage 1; micro-batches sent [0], received []. Add the RECV/WAIT "
                   "on stage 1")
    assert marks == ["0SEND_F0>1"]


def test_a_receive_nobody_sends():
    """A channel with a receive and no send at all; its WAIT follows the RECV at once."""
    msg, marks, _ = report(S(s0="0RECV_B0<1 0F0 0SEND_F0>1 0WAIT_B0<1 0B0",
                             s1="1RECV_F0<0 1WAIT_F0<0 1F0 1B0"))
    assert msg == ("channel 1->0 (B): stage 0 would be stuck at action #3 0WAIT_B0<1 (message "
                   "#0 on the channel) because stage 1 never sends it; micro-batches sent [], "
                   "received [0]. Add the missing SEND on stage 1 right after the compute "
                   "producing it")
    assert marks == ["0WAIT_B0<1"]
    # the WAIT right after its RECV is the one blamed, not the RECV
    msg, marks, _ = report(S(s0="0F0 0SEND_F0>1 0RECV_B0<1 0WAIT_B0<1 0B0",
                             s1="1RECV_F0<0 1WAIT_F0<0 1F0 1B0"))
    assert "stuck at action #3 0WAIT_B0<1" in msg and marks == ["0WAIT_B0<1"]


def test_messages_in_another_order():
    """Stage 0 sends micro-batches 1 then 0, stage 1 receives 0 then 1 (FIFO per channel)."""
    s0 = ("0RECV_B0<1 0RECV_B1<1 0F0 0F1 0SEND_F1>1 0SEND_F0>1 0WAIT_B0<1 0B0 0WAIT_B1<1 0B1")
    s1 = ("1RECV_F0<0 1RECV_F1<0 1WAIT_F0<0 1F0 1WAIT_F1<0 1F1 1B0 1SEND_B0>0 1B1 1SEND_B1>0")
    msg, marks, _ = report(S(s0=s0, s1=s1))
    assert msg == ("channel 0->1 (F): stage 1 would be stuck at action #2 1WAIT_F0<0 or compute "
                   "on the wrong data: it expects micro-batch 0 as message #0 on the channel, "
                   "but the send matching it (FIFO) is stage 0 action #4 0SEND_F1>1. "
                   "micro-batches sent [1, 0], received [0, 1]. Make both ends send and receive "
                   "in one order (is a SEND missing?)")
    assert marks == ["1WAIT_F0<0", "0SEND_F1>1"]


def test_a_missing_send_on_a_channel_that_has_others():
    s0 = "0F0 0F1 0SEND_F0>1"
    s1 = "1RECV_F0<0 1RECV_F1<0 1WAIT_F0<0 1F0 1WAIT_F1<0 1F1"
    msg, marks, _ = report(S(s0=s0, s1=s1))
    assert msg.startswith("channel 0->1 (F): stage 1 would be stuck at action #4 1WAIT_F1<0 "
                          "(message #1 on the channel) because stage 0 never sends it")
    assert marks == ["1WAIT_F1<0"]


def test_cross_waiting_stages_name_each_other():
    """Each stage waits for the other before sending: both are stuck, each blames the other's
    stuck action, and both stuck actions are marked."""
    s0 = "0RECV_B0<1 0WAIT_B0<1 0F0 0SEND_F0>1 0B0"
    s1 = "1RECV_F0<0 1WAIT_F0<0 1F0 1B0 1SEND_B0>0"
    msg, marks, grid = report(S(s0=s0, s1=s1))
    assert msg == (
        "deadlock: stage 0 stuck at action #1 0WAIT_B0<1 waiting for channel 1->0 (B) "
        "micro-batch 0, sent by stage 1 at #4 1SEND_B0>0; stage 1 is itself stuck at #1 "
        "1WAIT_F0<0\n"
        "deadlock: stage 1 stuck at action #1 1WAIT_F0<0 waiting for channel 0->1 (F) "
        "micro-batch 0, sent by stage 0 at #3 0SEND_F0>1; stage 0 is itself stuck at #1 "
        "0WAIT_B0<1\n"
        "Fix: reorder so that every stage posts/sends what its peer waits for before it waits "
        "itself (e.g. a send must not sit after a WAIT that depends on it).")
    assert marks == ["0WAIT_B0<1", "1WAIT_F0<0"]


def test_a_long_schedule_shows_six_steps_around_the_blamed_actions():
    actions = " ".join(f"0F{i}" for i in range(20)) + " 0F3"  # 0F3 again at #20
    msg, marks, grid = report(S(s0=actions))
    assert msg.startswith("stage 0 runs 0F3 twice (actions #3 and #20)")
    rows = [line.split()[0] for line in grid.splitlines()[1:]]
    assert rows == [str(i) for i in range(21)]  # #3 - 6 < 0 and #20 + 6 > 20: every step
    short = S(s0=" ".join(f"0F{i}" for i in range(30)) + " 0F20")
    _, _, grid = report(short)
    lines = grid.splitlines()
    assert lines[1] == "... (14 earlier steps)"  # 20 - 6: six steps of context before #20
    assert lines[-1].split()[0] == "30"  # and up to the end (#30 is the last step)
