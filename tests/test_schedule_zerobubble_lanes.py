"""Zero-bubble lane schedules (per-stage DP, ldt/schedule/zerobubble_lanes.py) and the
zero-bubble U-shape with prefetch.

Expected values come from hand arithmetic or from another generator, never from the one under
test: with one replica per stage and F = B = W = 1 a plain pipeline's iteration is the paper's
ZB-H1 ``3m + (P - 1)`` (m >= P); on the U-shape the list scheduler's order
(:func:`ldt.schedule.zerobubble.zb_u_shape`, a separate play) is timed by the simulator; the
lane lists with their backwards unsplit (today's VDP schedules) are the bound never to lose to.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ldt.schedule import Op, check_schedule, lower, simulate, u_shape
from ldt.schedule.routing import Lanes
from ldt.schedule.vdp import lane_prices, vdp_schedule
from ldt.schedule.zerobubble import Priced, unsplit, zb_u_shape

EDGE = ("FS", "FE", "BS", "BE", "WS", "WE")
WEIGHTS = {Op.B: Op.W, Op.BS: Op.WS, Op.BE: Op.WE}


def _costs(p: int, ushape: bool, draw=lambda: 1) -> dict:
    keys = ([(0, o) for o in EDGE] + [(s, o) for s in range(1, p) for o in "FBW"] if ushape
            else [(s, o) for s in range(p) for o in "FBW"])
    return {k: draw() for k in keys}


@pytest.mark.parametrize("p", range(2, 7))
def test_one_replica_per_stage_is_zb_h1_with_equal_costs(p):
    """F = B = W = 1, no transfer time: 3m + (P - 1) for m = P .. 2P (the paper's ZB-H1; 1F1B
    takes 3m + 3(P - 1))."""
    for m in range(p, 2 * p + 1):
        zb = simulate(vdp_schedule((1,) * p, m, False, zero_bubble=True), lambda a: 1)
        assert zb.iteration_time == 3 * m + p - 1, (p, m)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 2), (3, 4), (4, 4), (4, 8)])
def test_one_replica_per_stage_u_shape_as_fast_as_the_list_scheduler(p, m):
    """Edge ops 1, cloud ops 2: the kept-order lists are at least as fast as the list
    scheduler's U-shape (equal at P 2-3; at P 4, m 4: 29 against 31 units)."""
    costs = _costs(p, True)
    costs.update({k: 2 for k in costs if k[0] > 0})
    comm = {(a, b): 0 for a in range(p) for b in range(p) if a != b}
    lanes = simulate(vdp_schedule((1,) * p, m, True, zero_bubble=True,
                                  priced=Priced.of(costs, comm)),
                     *lane_prices(Lanes((1,) * p), Priced.of(costs, comm)))
    listed = simulate(lower(zb_u_shape(p, m, costs, comm), "ushape"), costs, comm)
    assert lanes.iteration_time <= listed.iteration_time


@st.composite
def vdp_pipelines(draw):
    p = draw(st.integers(min_value=2, max_value=4))
    dps = tuple(draw(st.sampled_from((1, 2, 4))) for _ in range(p))
    m = draw(st.integers(min_value=1, max_value=3 * p))
    ushape = draw(st.booleans())
    prefetch = draw(st.integers(min_value=0, max_value=1)) if ushape else 0
    costs = _costs(p, ushape, lambda: draw(st.integers(min_value=0, max_value=5)))
    comm = {(a, b): draw(st.integers(min_value=0, max_value=3))
            for a in range(p) for b in range(p) if a != b}
    return dps, m, ushape, prefetch, costs, comm


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vdp_pipelines())
def test_lane_schedules_split_every_backward_and_never_lose_to_todays(case):
    """P = 2..4, every stage dp in {1, 2, 4}, m = 1..3P, plain and U-shape (prefetch 0, 1),
    uneven integer costs (zeros too) and links: the lists pass the checker (deadlock-free, W
    after its B in B order), every backward of each of the D*m micro-batches has its W once on
    the replica that ran it, the F/B order and the messages are today's (the U-shape's: derived
    at today's backward ratio 2 or at the split B's mean ratio to F over the cloud stages), the
    W store never holds more entries than that order's lane holding most activations holds
    micro-batches, and the iteration is never longer than today's lists on the same work."""
    dps, m, ushape, prefetch, costs, comm = case
    priced = Priced.of(costs, comm)
    zb = vdp_schedule(dps, m, ushape, prefetch=prefetch, zero_bubble=True, priced=priced)
    today = vdp_schedule(dps, m, ushape, prefetch=prefetch)
    check_schedule(zb)
    lanes = Lanes(dps)
    for lane, actions in zb.items():
        backwards = [(a.op, a.mb) for a in actions if a.op in WEIGHTS]
        weights = [(op, a.mb) for a in actions for op in WEIGHTS if WEIGHTS[op] is a.op]
        assert sorted(weights) == sorted(backwards), lane
        assert all(a.mb % dps[lanes.of(lane)[0]] == lanes.of(lane)[1] for a in actions)
    kept = {lane: [a for a in actions if a.op not in WEIGHTS.values()]
            for lane, actions in zb.items()}
    ratios = [b / f for (s, op), b in costs.items() if op == "B" and s > 0
              for f in [costs[(s, "F")]] if f > 0]
    orders = [today] + ([vdp_schedule(dps, m, True, backward_ratio=sum(ratios) / len(ratios),
                                      prefetch=prefetch)] if ushape and ratios else [])
    order = next((o for o in orders if all(kept[x] == o[x] for x in o)), None)
    assert order is not None, "the zero-bubble lists reorder today's forwards and backwards"
    duration, comm_time = lane_prices(lanes, priced)
    whole, _ = lane_prices(lanes, Priced.of(unsplit(costs), comm))
    split = simulate(zb, duration, comm_time)
    assert split.iteration_time <= simulate(today, whole, comm_time).iteration_time
    # the W store holds at most what the lane holding most activations holds of them
    held = simulate(order, whole, comm_time)
    assert max(split.peak_wstore.values()) <= max(
        held.peak_inflight[x] + held.peak_inflight_end.get(x, 0) for x in order)


def test_edge_serving_two_cloud_replicas_gains_from_the_split():
    """conf/cluster/cpu_vdp's shape (edge dp 1, cloud dp 2, U-shape), edge ops 1, cloud F 2,
    B 2, W 2, transfers 1: shorter than today's lists with B + W unsplit."""
    costs = _costs(2, True)
    costs.update({(1, "F"): 2, (1, "B"): 2, (1, "W"): 2})
    comm = {(0, 1): 1, (1, 0): 1}
    priced, lanes = Priced.of(costs, comm), Lanes((1, 2))
    duration, comm_time = lane_prices(lanes, priced)
    whole, _ = lane_prices(lanes, Priced.of(unsplit(costs), comm))
    for m in (2, 4):
        zb = simulate(vdp_schedule((1, 2), m, True, zero_bubble=True, priced=priced),
                      duration, comm_time).iteration_time
        today = simulate(vdp_schedule((1, 2), m, True), whole, comm_time).iteration_time
        assert zb < today, (m, zb, today)


def test_evaluation_lists_have_no_w():
    lists = vdp_schedule((1, 2), 2, True, forward_only=True, zero_bubble=True)
    assert not any(a.op in WEIGHTS.values() for acts in lists.values() for a in acts)


# ---- the uniform zero-bubble U-shape with prefetch ---------------------------------------
def test_zb_u_shape_with_prefetch_checks_and_runs_ahead_over_slow_edge_links():
    """P = 2..5, m = 1..3P, prefetch 1 and 2: checked as lowered with the same depth; with
    the edge's links slow (4 against compute 1-2) each depth shortens the iteration, and the
    zero-bubble order beats today's U-shape at the same depth."""
    for p, d in itertools.product(range(2, 6), (1, 2)):
        for m in range(1, 3 * p + 1):
            check_schedule(lower(zb_u_shape(p, m, prefetch=d), "ushape", prefetch=d))
    p, m = 3, 6
    costs = _costs(p, True)
    costs.update({k: 2 for k in costs if k[0] > 0})
    comm = {(0, 1): 4, (1, 0): 4, (1, 2): 0, (2, 1): 0, (2, 0): 4, (0, 2): 4}
    times = []
    for d in (0, 1, 2):
        zb = simulate(lower(zb_u_shape(p, m, costs, comm, prefetch=d), "ushape", prefetch=d),
                      costs, comm).iteration_time
        today = simulate(lower(u_shape(p, m, prefetch=d), "ushape", prefetch=d),
                         unsplit(costs), comm).iteration_time
        assert zb < today, (d, zb, today)
        times.append(zb)
    assert times[0] > times[1] > times[2], times


def test_zb_u_shape_refuses_a_bad_prefetch():
    with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
        zb_u_shape(3, 3, prefetch=-1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vdp_pipelines())
def test_the_fastest_placement_is_kept(case):
    """split_backwards keeps, of the lists it plays (``played``: each W right after its
    backward; both fills at both W store sizes), the one the simulator times fastest with the
    run's prices, transfers included; and every one of them splits every backward."""
    from ldt.schedule import zerobubble_lanes as zl

    dps, m, ushape, prefetch, costs, comm = case
    today = vdp_schedule(dps, m, ushape, prefetch=prefetch)
    duration, comm_time = lane_prices(Lanes(dps), Priced.of(costs, comm))
    candidates = zl.played(today, duration, comm_time)
    assert len(candidates) == 5
    for lists in candidates:
        check_schedule(lists)
    times = [simulate(c, duration, comm_time).iteration_time for c in candidates]
    kept = zl.split_backwards(today, duration, comm_time)
    assert simulate(kept, duration, comm_time).iteration_time == min(times)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vdp_pipelines())
def test_a_w_fills_only_a_wait(case):
    """Where a play puts W's right before a WAIT (to fill it), timed by the simulator: with
    ``fill="fit"`` each ends by the time the awaited message arrives (it delays nothing), with
    ``fill="idle"`` each starts by then (the lane would have waited, or, with zero-time
    actions, the message arrives at that very moment); and each W's backward ran before it
    (the checker's rule, on the play's own lists)."""
    from ldt.schedule import zerobubble_lanes as zl
    from ldt.schedule.simulate import prepare

    dps, m, ushape, prefetch, costs, comm = case
    today = vdp_schedule(dps, m, ushape, prefetch=prefetch)
    duration, comm_time = lane_prices(Lanes(dps), Priced.of(costs, comm))
    caps = {x: 1 for x in today}
    for fill in ("fit", "idle"):
        lists = type(today)(zl._place(today, prepare(today).matches, duration, comm_time, caps,
                                      fill), today.microbatches)
        check_schedule(lists)
        prepared = prepare(lists)
        sim = simulate(prepared, duration, comm_time)
        events = {(e.stage, i): e for lane in sorted(lists)
                  for i, e in enumerate(x for x in sim.events if x.stage == lane)}
        for lane, actions in lists.items():
            for i, a in enumerate(actions):
                if a.op not in (Op.WAIT_F, Op.WAIT_B):
                    continue
                send = prepared.matches[(lane, i)]
                arrival = events[send].start + comm_time(lists[send[0]][send[1]])
                j = i - 1
                while j >= 0 and actions[j].op in WEIGHTS.values():
                    w = events[(lane, j)]
                    assert (w.end <= arrival) if fill == "fit" else (w.start <= arrival), \
                        (fill, lane, str(actions[j]), w, arrival)
                    j -= 1
