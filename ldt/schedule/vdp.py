"""Schedules with per-stage data parallelism (VDP): one action list per lane (stage replica).

The routing (which replica runs which micro-batch) is :mod:`ldt.schedule.routing`'s; this module
turns it into :class:`~ldt.schedule.ir.LaneSchedule` s that the deadlock checker, the simulator
and the runtime take as they take a uniform schedule (lanes where stages were):

* :func:`vdp_one_f_one_b`: every lane runs 1F1B over its own micro-batches (ascending). A lane
  of stage ``s`` holds ``(P-s-1) * D/dp_s`` micro-batches in warmup: as many as the uniform
  1F1B's ``P-s-1`` for each of the ``D/dp_s`` uniform replicas it stands in for, so a replica
  that serves several downstream replicas in turn keeps each of them fed.
* :func:`vdp_u_shape`: the U-shape derived as :func:`ldt.schedule.generate.u_shape` derives it
  (the edge's two chunks are logical stages 0 and P of a (P+1)-stage 1F1B, merged by start time
  of a play with F = 1, B = ``backward_ratio``), with lanes for every logical stage.
* :func:`lower_lanes`: SEND/RECV/WAIT with peers from the routing (fan-out: a replica sends its
  micro-batches to the downstream replicas that run them, in turn; fan-in: it receives from
  each upstream replica on that pair's own FIFO channel).
* :func:`vdp_schedule`: generate + lower + check, what the runtime and the planner use;
  ``zero_bubble``: each backward split, its W placed by
  :func:`ldt.schedule.zerobubble_lanes.split_backwards` from the run's prices.
"""

from __future__ import annotations

from fractions import Fraction

from ldt.schedule.check import check_schedule
from ldt.schedule.generate import (_EDGE_RANK, _input_channel, _output_channel, _require,
                                   forwards_of)
from ldt.schedule.ir import Action, Op, LaneSchedule
from ldt.schedule.routing import Lanes, microbatches_of
from ldt.schedule.simulate import simulate
from ldt.schedule.zerobubble import Priced
from ldt.schedule.zerobubble_lanes import split_backwards


def lane_microbatches(stage_dp: tuple[int, ...], m: int, step: int = 0) -> dict[int, list[int]]:
    """Lane id -> its micro-batches (ascending), for ``m`` micro-batches per uniform replica."""
    lanes, dp_max = Lanes(tuple(stage_dp)), max(stage_dp)
    return {lanes.lane(s, r): microbatches_of(r, d, m, dp_max, step)
            for s, d in enumerate(stage_dp) for r in range(d)}


def _lane_1f1b(lane: int, mbs: list[int], warmup: int, fwd: Op = Op.F,
               bwd: Op = Op.B) -> list[Action]:
    w = min(warmup, len(mbs))
    actions = [Action(lane, fwd, mb) for mb in mbs[:w]]
    for i in range(len(mbs) - w):
        actions += [Action(lane, fwd, mbs[w + i]), Action(lane, bwd, mbs[i])]
    return actions + [Action(lane, bwd, mb) for mb in mbs[len(mbs) - w:]]


def vdp_one_f_one_b(stage_dp: tuple[int, ...], m: int) -> LaneSchedule:
    """Plain pipeline, compute only (see the module docstring)."""
    _check_args(stage_dp, m)
    p, dp_max, lanes = len(stage_dp), max(stage_dp), Lanes(tuple(stage_dp))
    mbs = lane_microbatches(stage_dp, m)
    out = {}
    for lane in range(len(lanes)):
        s, _ = lanes.of(lane)
        out[lane] = _lane_1f1b(lane, mbs[lane], (p - s - 1) * (dp_max // stage_dp[s]))
    return LaneSchedule(out, mbs)


def vdp_u_shape(stage_dp: tuple[int, ...], m: int, backward_ratio: float = 2,
                prefetch: int = 0) -> LaneSchedule:
    """U-shape, compute only: edge lanes (stage 0) run FS/FE/BS/BE, cloud lanes F/B.
    ``prefetch``: as :func:`ldt.schedule.generate.u_shape`'s (d more warmup forwards per slow
    edge link downstream, per uniform replica stood in for; merged with a latency of d)."""
    _check_args(stage_dp, m)
    p, d = len(stage_dp), prefetch
    _require(p >= 2, f"the U-shape needs P >= 2 stages (edge + cloud), got P={p}")
    _require(isinstance(d, int) and d >= 0, f"prefetch must be an integer >= 0, got {d!r}")
    logical_dp = tuple(stage_dp) + (stage_dp[0],)  # logical stage P: the edge's end chunk
    dp_max = max(stage_dp)
    lanes, logical = Lanes(tuple(stage_dp)), Lanes(logical_dp)
    mbs = lane_microbatches(logical_dp, m)
    # warmups of the (P+1)-stage 1F1B (as generate.u_shape), per uniform replica stood in for
    warmups = [p + 2 * d] + [p - s + d for s in range(1, p)] + [0]
    plan = {}
    for lane in range(len(logical)):
        s, _ = logical.of(lane)
        plan[lane] = _lane_1f1b(lane, mbs[lane], warmups[s] * (dp_max // logical_dp[s]))
    played = _play(LaneSchedule(plan, mbs), logical, p + 1, Fraction(backward_ratio), d)
    out = {}
    for lane in range(len(lanes)):
        s, r = lanes.of(lane)
        if s:
            out[lane] = [Action(lane, a.op, a.mb) for a in plan[logical.lane(s, r)]]
            continue
        start_lane, end_lane = logical.lane(0, r), logical.lane(p, r)
        units = []
        for a in plan[start_lane]:
            op = Op.FS if a.op is Op.F else Op.BE
            units.append(((played[(start_lane, a.op, a.mb)], _EDGE_RANK[op], a.mb),
                          [Action(lane, op, a.mb)]))
        for a in plan[end_lane]:
            if a.op is Op.F:
                units.append(((played[(end_lane, Op.F, a.mb)], _EDGE_RANK[Op.FE], a.mb),
                              [Action(lane, Op.FE, a.mb), Action(lane, Op.BS, a.mb)]))
        units.sort(key=lambda unit: unit[0])
        out[lane] = [a for _, unit in units for a in unit]
    return LaneSchedule(out, {lane: mbs[lane] for lane in range(len(lanes))})


def _play(plan: LaneSchedule, logical: Lanes, num_stages: int, backward_ratio: Fraction,
          latency: int = 0) -> dict:
    backward = backward_ratio.numerator if backward_ratio.denominator == 1 else backward_ratio
    p = num_stages - 1
    slow = {(0, 1), (1, 0), (p - 1, p), (p, p - 1)}

    def comm(send: Action) -> int:
        pair = (logical.of(send.stage)[0], logical.of(send.peer)[0])
        return latency if pair in slow else 0

    result = simulate(lower_lanes(plan, logical.stage_dp, "1f1b"),
                      duration=lambda a: 1 if a.op is Op.F else backward, comm_time=comm)
    return {(e.stage, e.action.op, e.action.mb): e.start for e in result.events
            if e.action.is_compute}


def lower_lanes(schedule: LaneSchedule, stage_dp: tuple[int, ...], kind: str,
                prefetch: int = 0) -> LaneSchedule:
    """Add communication to a compute-only lane schedule (the rules of
    :func:`ldt.schedule.generate.lower`; a channel is a pair of lanes and a direction): one
    receive outstanding per channel, ``1 + 2 * prefetch`` on a U-shape's channels that touch
    the edge (stage 0)."""
    lanes, p = Lanes(tuple(stage_dp)), len(stage_dp)
    edge_ahead = 1 + 2 * prefetch if kind == "ushape" else 1

    def channel(lane: int, a: Action, which) -> tuple | None:
        stage = lanes.of(lane)[0]
        ch = which(Action(stage, a.op, a.mb), p, kind)
        if ch is None:
            return None
        src, dst, direction = ch
        return (lanes.peer(src, a.mb) if src != stage else lane,
                lanes.peer(dst, a.mb) if dst != stage else lane, direction)

    out = {}
    for lane, actions in schedule.items():
        incoming: dict[tuple, list[int]] = {}
        for a in actions:
            ch = channel(lane, a, _input_channel)
            if ch is not None:
                incoming.setdefault(ch, []).append(a.mb)
        recv = {"F": Op.RECV_F, "B": Op.RECV_B}
        ahead = {ch: edge_ahead if 0 in (lanes.of(ch[0])[0], lanes.of(ch[1])[0]) else 1
                 for ch in incoming}
        lowered = [Action(lane, recv[ch[2]], mb, ch[0])
                   for ch, mbs in incoming.items() for mb in mbs[:ahead[ch]]]
        position = {ch: 0 for ch in incoming}
        for a in actions:
            ch = channel(lane, a, _input_channel)
            if ch is not None:
                lowered.append(Action(lane, Op.WAIT_F if ch[2] == "F" else Op.WAIT_B, a.mb,
                                      ch[0]))
                position[ch] += 1
                later = position[ch] + ahead[ch] - 1
                if later < len(incoming[ch]):
                    lowered.append(Action(lane, recv[ch[2]], incoming[ch][later], ch[0]))
            lowered.append(a)
            ch = channel(lane, a, _output_channel)
            if ch is not None:
                lowered.append(Action(lane, Op.SEND_F if ch[2] == "F" else Op.SEND_B, a.mb,
                                      ch[1]))
        out[lane] = lowered
    return LaneSchedule(out, schedule.microbatches)


def vdp_schedule(stage_dp: tuple[int, ...], m: int, u_shape: bool,
                 forward_only: bool = False, backward_ratio: float = 2,
                 prefetch: int = 0, zero_bubble: bool = False,
                 priced: Priced | None = None) -> LaneSchedule:
    """Generated, lowered and deadlock-checked lane lists (``m``: per uniform replica;
    ``prefetch``: the U-shape's depth; ``zero_bubble``: every backward split into B and a later
    W placed by the play of ``priced``, the run's per-stage costs (None: all equal); the
    U-shape's order then derived at ``backward_ratio`` and at the split B's ratio to F, the
    faster kept)."""
    stage_dp = tuple(stage_dp)
    _require(u_shape or not prefetch, f"prefetch={prefetch} is for the U-shape only")
    if not zero_bubble or forward_only:
        return _lowered(stage_dp, m, u_shape, forward_only, backward_ratio, prefetch)
    duration, comm_time = lane_prices(Lanes(stage_dp), priced)
    ratios = [backward_ratio] + ([_split_ratio(stage_dp, priced)] if u_shape and priced else [])
    candidates = [split_backwards(_lowered(stage_dp, m, u_shape, False, r, prefetch),
                                  duration, comm_time) for r in ratios]
    return min(candidates, key=lambda s: simulate(s, duration, comm_time).iteration_time)


def _lowered(stage_dp: tuple[int, ...], m: int, u_shape: bool, forward_only: bool,
             backward_ratio: float, prefetch: int) -> LaneSchedule:
    compute = (vdp_u_shape(stage_dp, m, backward_ratio, prefetch) if u_shape
               else vdp_one_f_one_b(stage_dp, m))
    if forward_only:
        compute = LaneSchedule(forwards_of(compute), compute.microbatches)
    schedule = lower_lanes(compute, stage_dp, "ushape" if u_shape else "1f1b", prefetch)
    check_schedule(schedule)
    return schedule


def _split_ratio(stage_dp: tuple[int, ...], priced: Priced) -> float:
    """The cloud stages' mean B / F under ``priced`` (B without its W): the ratio the U-shape's
    order is played at when the backward is split (2 where no stage has a forward time)."""
    costs, _ = priced.tables()
    ratios = [costs[(s, "B")] / costs[(s, "F")] for s in range(1, len(stage_dp))
              if costs[(s, "F")] > 0]
    return sum(ratios) / len(ratios) if ratios else 2


def lane_prices(lanes: Lanes, priced: Priced | None):
    """``(duration, comm_time)`` of lane actions from per-stage zero-bubble prices (a lane
    costs what its stage does; a transfer what its stages' boundary does); None: every
    computation 1, every transfer 0."""
    if priced is None:
        return (lambda a: 1), (lambda a: 0)
    costs, comm = priced.tables()
    per_stage: dict[int, dict[Op, float]] = {}
    for (stage, op), t in costs.items():
        per_stage.setdefault(stage, {})[Op(op)] = t
    return lane_cost(lanes, per_stage), \
        lambda a: comm.get((lanes.of(a.stage)[0], lanes.of(a.peer)[0]), 0)


def lane_cost(lanes: Lanes, per_stage: dict[int, dict[Op, float]]):
    """A simulator ``duration`` from per-stage cost tables (a lane costs what its stage does)."""
    def duration(action: Action) -> float:
        return per_stage[lanes.of(action.stage)[0]][action.op]

    return duration


def _check_args(stage_dp, m: int) -> None:
    _require(len(stage_dp) >= 1 and all(d >= 1 for d in stage_dp) and m >= 1,
             f"need >= 1 stage, every dp >= 1 and m >= 1; got dp {list(stage_dp)}, m={m}")
    dp_max = max(stage_dp)
    _require(all(dp_max % d == 0 for d in stage_dp),
             f"every stage dp must divide the largest ({dp_max}); got {list(stage_dp)}")
