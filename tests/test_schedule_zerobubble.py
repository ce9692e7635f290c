"""Zero-bubble schedules (ldt/schedule/zerobubble.py) and the W ops in the IR, checker and
simulator.

Expected values come from hand arithmetic, never from the generator: ZB-H1's iteration with
F = B = W = 1 is the paper's ``3m + (P - 1)`` against 1F1B's ``3m + 3(P - 1)`` (Qi et al.,
ICLR'24: a bubble of ``(P - 1)(F + B - W)`` against ``(P - 1)(F + B + W)``); today's schedules
are timed by the existing generators and simulator on the same work (``unsplit``); the bound
that says why a third is out of reach at ``m = P`` is worked out in the test's docstring.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ldt.schedule import (Action, Op, ScheduleError, check_schedule, forwards_of, lower,
                          one_f_one_b, parse_action, simulate, u_shape)
from ldt.schedule.zerobubble import unsplit, zb_h1, zb_u_shape

EDGE = ("FS", "FE", "BS", "BE", "WS", "WE")


def plain_costs(p, f=1, b=1, w=1):
    return {(s, o): t for s in range(p) for o, t in (("F", f), ("B", b), ("W", w))}


def ushape_costs(p, edge=Fraction(1, 2), cloud=1):
    out = {(0, o): edge for o in EDGE}
    out.update({(s, o): cloud for s in range(1, p) for o in "FBW"})
    return out


def idle(result, work):
    """Idle stage-time of one iteration: what the paper's bubble rate divides by the work."""
    return result.num_stages * result.iteration_time - work


def test_w_ops_print_and_parse():
    for text in ("0WS3", "0WE0", "2W1", "0WAIT_F1<1", "1B0"):
        assert str(parse_action(text)) == text
    assert parse_action("3W2") == Action(3, Op.W, 2)
    assert parse_action("0WS1").op is Op.WS and parse_action("0WE1").op is Op.WE


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h1_equal_costs_is_the_papers_schedule(p):
    """F = B = W = 1: ZB-H1 takes 3m + (P - 1), 1F1B 3m + 3(P - 1) (the paper's bubbles), so
    its idle time is exactly a third of 1F1B's, with 1F1B's activations (peak in-flight)."""
    costs = plain_costs(p)
    for m in (p, p + 1, 2 * p, 3 * p):
        zb = simulate(lower(zb_h1(p, m, costs), "1f1b"), costs)
        base = simulate(lower(one_f_one_b(p, m), "1f1b"), unsplit(costs))
        assert zb.iteration_time == 3 * m + (p - 1), (p, m)
        assert base.iteration_time == 3 * m + 3 * (p - 1), (p, m)
        assert idle(zb, 3 * m * p) * 3 == idle(base, 3 * m * p)
        assert zb.peak_inflight == base.peak_inflight
        # W store: the last stage defers the most (ZB-H1: each stage holds P + 1 at most)
        assert all(zb.peak_inflight[s] + zb.peak_wstore[s] <= p + 1 for s in range(p))


def test_equal_costs_u_shape_reaches_a_third_from_2p_micro_batches():
    """The U-shape's edge runs two half-size chunks (F = B = W = 1/2 each), the cloud 1: at
    m = 2P the zero-bubble U-shape idles at most a third of today's U-shape (P = 3, 4, 6)."""
    for p in (3, 4, 6):
        costs, m = ushape_costs(p), 2 * p
        work = 3 * m * p
        zb = simulate(lower(zb_u_shape(p, m, costs), "ushape"), costs)
        today = simulate(lower(u_shape(p, m), "ushape"), unsplit(costs))
        assert 3 * idle(zb, work) <= idle(today, work), (p, idle(zb, work), idle(today, work))
        assert zb.peak_inflight == today.peak_inflight  # the same activations held


# a heterogeneous U-shape, balanced as a planner balances it (each stage ~3 units of work per
# micro-batch) but uneven in every other way: the edge's two chunks, the F:B:W mix per stage
# (attention- or MLP-heavy layers), and slow edge <-> cloud links beside fast cloud links
HETERO_P = 4
HETERO = {
    (0, "FS"): Fraction(6, 10), (0, "BE"): Fraction(5, 10), (0, "WE"): Fraction(3, 10),
    (0, "FE"): Fraction(5, 10), (0, "BS"): Fraction(6, 10), (0, "WS"): Fraction(5, 10),
    (1, "F"): Fraction(9, 10), (1, "B"): Fraction(11, 10), (1, "W"): Fraction(9, 10),
    (2, "F"): Fraction(11, 10), (2, "B"): Fraction(10, 10), (2, "W"): Fraction(8, 10),
    (3, "F"): Fraction(8, 10), (3, "B"): Fraction(12, 10), (3, "W"): Fraction(10, 10),
}
HETERO_COMM = {(0, 1): Fraction(2, 10), (1, 0): Fraction(2, 10), (3, 0): Fraction(2, 10),
               (0, 3): Fraction(2, 10), (1, 2): Fraction(1, 20), (2, 1): Fraction(1, 20),
               (2, 3): Fraction(1, 20), (3, 2): Fraction(1, 20)}


def test_heterogeneous_u_shape_at_m_equal_p_and_why_not_a_third():
    """At m = P no order of these ops can idle a third of today's U-shape, and the zero-bubble
    U-shape is between today's and that bound.

    Why: every backward of cloud stage 1 waits for the gradient of micro-batch 0, which has to
    go round the whole U first: FS, F1..F3, FE, BS, B3, B2 and 7 transfers (3 on edge links,
    4 on cloud links), r = 0.6 + 2.8 + 0.5 + 0.6 + 2.2 + (3 x 0.2 + 4 x 0.05) = 7.5. After it,
    stage 1 still runs its m backwards and W's, 4 x (1.1 + 0.9) = 8, so no schedule ends
    before 15.5. The work is m x 11.8 = 47.2 stage-time, so idle >= 4 x 15.5 - 47.2 = 14.8.
    Today's U-shape idles 36.8 (T = 21, simulated): the bound is 0.40 of it, and a third
    (12.27) is below what any order of these ops can reach.
    """
    p, m = HETERO_P, HETERO_P
    work = m * sum(HETERO.values())
    assert work == Fraction(472, 10)
    bound = 4 * Fraction(155, 10) - work
    zb = simulate(lower(zb_u_shape(p, m, HETERO, HETERO_COMM), "ushape"), HETERO, HETERO_COMM)
    today = simulate(lower(u_shape(p, m), "ushape"), unsplit(HETERO), HETERO_COMM)
    assert today.iteration_time == 21 and idle(today, work) == Fraction(368, 10)
    assert bound <= idle(zb, work) < idle(today, work)
    assert 3 * bound > idle(today, work)  # a third is below what any order can reach
    assert idle(zb, work) <= Fraction(55, 100) * idle(today, work)  # measured: 0.49
    assert zb.iteration_time <= Fraction(85, 100) * today.iteration_time  # measured: 0.78


costs_strategy = st.integers(min_value=0, max_value=6)


@st.composite
def pipelines(draw):
    p = draw(st.integers(min_value=2, max_value=8))
    m = draw(st.integers(min_value=1, max_value=3 * p))
    ushape = draw(st.booleans())
    if ushape:
        keys = [(0, o) for o in EDGE] + [(s, o) for s in range(1, p) for o in "FBW"]
    else:
        keys = [(s, o) for s in range(p) for o in "FBW"]
    costs = {k: draw(costs_strategy) for k in keys}
    pairs = [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if ushape else [])
    comm = {}
    for a, b in pairs:
        comm[(a, b)] = draw(st.integers(min_value=0, max_value=3))
        comm[(b, a)] = draw(st.integers(min_value=0, max_value=3))
    return p, m, ushape, costs, comm


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_generated_schedules_check_and_never_lose_to_todays(case):
    """P = 2..8, m = 1..3P, uneven integer costs (zeros too) and links: every schedule passes
    the checker (each F/B/W once, W after its B in B order, deadlock-free), holds no more
    activations than today's schedule, and is never slower than it on the same work."""
    p, m, ushape, costs, comm = case
    kind = "ushape" if ushape else "1f1b"
    compute = (zb_u_shape if ushape else zb_h1)(p, m, costs, comm)
    schedule = lower(compute, kind)
    check_schedule(schedule)
    check_schedule(lower(forwards_of(compute), kind))  # its evaluation schedule too
    assert sum(a.op in (Op.W, Op.WS, Op.WE) for acts in compute.values() for a in acts) == \
        m * (p + 1 if ushape else p)
    zb = simulate(schedule, costs, comm)
    base = lower(u_shape(p, m) if ushape else one_f_one_b(p, m), kind)
    today = simulate(base, unsplit(costs), comm)
    assert zb.iteration_time <= today.iteration_time
    for s in range(p):
        assert zb.peak_inflight[s] <= today.peak_inflight[s]
        assert zb.peak_inflight_end.get(s, 0) <= today.peak_inflight_end.get(s, 0)
        assert 1 <= zb.peak_wstore[s] <= p + 1


def test_caps_are_honoured():
    costs = plain_costs(4, 1, 2, 1)
    for held, store in ((1, 1), (2, 1), (1, 3)):
        result = simulate(lower(zb_h1(4, 8, costs, max_held=held, max_wstore=store), "1f1b"),
                          costs)
        assert max(result.peak_inflight.values()) <= held
        assert max(result.peak_wstore.values()) <= store
    held = [2, 2, 2, 1, 1]  # start chunk, cloud 1..3, end chunk
    compute = zb_u_shape(4, 6, ushape_costs(4), max_held=held, max_wstore=2)
    result = simulate(lower(compute, "ushape"), ushape_costs(4))
    assert result.peak_inflight == {0: 2, 1: 2, 2: 2, 3: 1} and result.peak_inflight_end == {0: 1}
    assert max(result.peak_wstore.values()) <= 2


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"costs has no time for \[\(2, 'W'\)\]"):
        zb_h1(3, 3, {k: 1 for k in plain_costs(3) if k != (2, "W")})
    with pytest.raises(ValueError, match=r"comm has no time for the boundaries \[\(2, 0\)"):
        zb_u_shape(3, 3, None, {(0, 1): 0, (1, 0): 0, (1, 2): 0, (2, 1): 0})
    with pytest.raises(ValueError, match=r"max_held needs 4 values"):
        zb_u_shape(3, 3, max_held=[1, 1])
    with pytest.raises(ValueError, match=r"max_wstore must be integers >= 1"):
        zb_h1(3, 3, max_wstore=0)
    with pytest.raises(ValueError, match=r"P >= 2 stages"):
        zb_u_shape(1, 3)


def test_unsplit_adds_each_w_to_its_backward():
    costs = {(0, "FS"): 1, (0, "BE"): 2, (0, "WE"): 3, (0, "FE"): 4, (0, "BS"): 5, (0, "WS"): 6,
             (1, "F"): 7, (1, "B"): 8, (1, "W"): 9}
    assert unsplit(costs) == {(0, "FS"): 1, (0, "BE"): 5, (0, "FE"): 4, (0, "BS"): 11,
                              (1, "F"): 7, (1, "B"): 17}


# ---- the checker's W rules ------------------------------------------------------------------
def _plain(lists: dict[int, str]):
    return lower({s: [parse_action(t) for t in text.split()] for s, text in lists.items()},
                 "1f1b")


def test_checker_accepts_w_after_its_b_in_b_order():
    check_schedule(_plain({0: "0F0 0F1 0B0 0B1 0W0 0W1", 1: "1F0 1B0 1F1 1W0 1B1 1W1"}))


@pytest.mark.parametrize("lists, message", [
    ({0: "0F0 0W0 0B0", 1: "1F0 1B0 1W0"},
     r"stage 0 runs 0W0 at #3 before 0B0; a weight gradient \(W\) runs after the backward \(B\)"),
    ({0: "0F0 0F1 0B0 0B1 0W1 0W0", 1: "1F0 1B0 1W0 1F1 1B1 1W1"},
     r"stage 0 runs 0W1 at #\d+ before 0W0; W ops run in the order of their B ops"),
    ({0: "0F0 0B0 0W0 0W0", 1: "1F0 1B0 1W0"}, r"stage 0 runs 0W0 twice"),
    ({0: "0F0 0F1 0B0 0B1 0W0", 1: "1F0 1B0 1F1 1B1"}, r"stage 0 never runs 0W1"),
    ({0: "0F0 0B0 0WS0", 1: "1F0 1B0"}, r"stage 0 mixes plain ops"),
])
def test_checker_refuses_misplaced_w(lists, message):
    # the positions are in the lowered lists (with their RECV / WAIT / SEND)
    with pytest.raises(ScheduleError, match=message):
        check_schedule(_plain(lists))


def test_u_shape_edge_w_ops_pair_with_their_backward():
    """WS follows BS (end chunk), WE follows BE (start chunk); either may run before the other
    chunk's backward."""
    ok = {0: "0FS0 0FE0 0BS0 0WS0 0BE0 0WE0", 1: "1F0 1B0 1W0"}
    check_schedule(lower({s: [parse_action(t) for t in v.split()] for s, v in ok.items()},
                         "ushape"))
    bad = {0: "0FS0 0FE0 0WS0 0BS0 0BE0 0WE0", 1: "1F0 1B0 1W0"}
    with pytest.raises(ScheduleError, match=r"0WS0 at #\d+ before 0BS0"):
        check_schedule(lower({s: [parse_action(t) for t in v.split()] for s, v in bad.items()},
                             "ushape"))


def test_simulator_counts_the_w_store():
    schedule = _plain({0: "0F0 0F1 0B0 0B1 0W0 0W1", 1: "1F0 1B0 1F1 1W0 1B1 1W1"})
    result = simulate(schedule, plain_costs(2))
    assert result.peak_wstore == {0: 2, 1: 1}
    assert result.peak_inflight == {0: 2, 1: 1}  # activations: forward to backward, as before
