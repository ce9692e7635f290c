"""Schedule generators (compute only) and the lowering pass that adds communication.

* :func:`one_f_one_b` is Megatron's 1F1B: stage ``s`` of ``P`` runs ``min(P-s-1, m)`` warmup
  forwards, then one forward / one backward, then the remaining backwards.
* :func:`u_shape` is the edge-cloud schedule: stage 0 (the edge) holds the start chunk and the end
  chunk and runs FS/FE/BS/BE per micro-batch; stages 1..P-1 (the cloud) run F/B. Its order is
  derived, not hard-coded: see :func:`u_shape` and ``docs/ushape_schedule.md``.
* :func:`forwards_of` keeps the forwards of a training schedule (evaluation).
* :func:`lower` turns a compute-only schedule into one with SEND/RECV/WAIT actions.
"""

from __future__ import annotations

from fractions import Fraction

from ldt.schedule.ir import FORWARD_OPS, Action, Channel, Op, Schedule
from ldt.schedule.simulate import simulate

KINDS = ("1f1b", "ushape")
_EDGE_RANK = {Op.FS: 0, Op.FE: 1, Op.BS: 2, Op.BE: 3}


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Plain 1F1B over ``num_stages`` stages; the last stage computes the loss inside its F."""
    _require(num_stages >= 1 and num_microbatches >= 1,
             f"1F1B needs >= 1 stage and >= 1 micro-batch, got P={num_stages}, m={num_microbatches}")
    return {
        s: _one_f_one_b_stage(s, min(num_stages - s - 1, num_microbatches), num_microbatches,
                              Op.F, Op.B)
        for s in range(num_stages)
    }


def _one_f_one_b_stage(stage: int, warmup: int, m: int, fwd: Op, bwd: Op) -> list[Action]:
    """``warmup`` forwards, then (forward, backward) pairs, then the remaining backwards."""
    actions = [Action(stage, fwd, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        actions += [Action(stage, fwd, warmup + i), Action(stage, bwd, i)]
    actions += [Action(stage, bwd, mb) for mb in range(m - warmup, m)]
    return actions


def u_shape(num_stages: int, num_microbatches: int, backward_ratio: float = 2,
            prefetch: int = 0) -> Schedule:
    """The U-shape schedule: edge = stage 0 (FS/FE/BS/BE), cloud = stages 1..P-1 (F/B).

    Why this order: seen from the data flow, the U-shape is a (P+1)-stage pipeline whose first
    logical stage (start chunk) and last logical stage (end chunk) share one device. So:

    1. cloud stage ``s`` runs the list of logical stage ``s`` of a (P+1)-stage 1F1B (warmup
       ``min(P-s, m)``: one more than a P-stage 1F1B, since the end chunk is still ahead of it);
    2. the edge's two chunks run the lists of logical stages 0 and P of that 1F1B, merged in the
       order they start when the (P+1)-stage 1F1B is played with costs F = 1, B =
       ``backward_ratio``; the end chunk's (FE, BS) pair is one unit (the loss's backward follows
       it at once); ties go FS, FE, BS, BE.

    ``backward_ratio`` is the cloud's backward/forward time ratio (2 is typical without
    recomputation; the reference's "2(P-1)/3" comes from it). It only decides how far the end
    chunk runs ahead of the start chunk's backwards; any value gives a correct schedule, the
    measured one gives the best.

    Merging by start time of a valid play keeps every dependency (a producer starts strictly
    before its consumer), so the merged edge never waits for something the cloud can only send
    after the edge's next action: the schedule is deadlock-free for every P >= 2 and m >= 1.
    When the edge's four chunks together cost no more than a cloud stage's F+B, the cloud runs
    exactly as in the (P+1)-stage 1F1B, i.e. with no extra steady-state bubble.

    ``prefetch`` (d >= 0) makes the schedule tolerate edge <-> cloud link latency. In 1F1B two
    neighbours run in lock step: stage s sends its next forward only after the backward that
    came back from s+1, so a one-way latency L on their link costs a bubble once 2L exceeds
    the slack of that loop. Every extra warmup micro-batch of s over s+1 adds one F+B period of
    slack. The U-shape has two slow links, edge -> first cloud stage and last cloud stage ->
    edge (end chunk), so d adds d warmup forwards per slow link downstream: every cloud stage
    runs d more (for the return link; they keep their lead over each other), the edge's start
    chunk 2d more (for both). Memory: d more micro-batches in flight on every cloud stage,
    2d more in the edge's start chunk (the end chunk still holds one). The merge is played with
    a one-way latency of d cloud forwards on the two slow links (the order then leaves room
    for the messages; with d = 0 nothing changes). Receives on those links are posted ahead
    too (:func:`lower` with ``prefetch``), so early sends also travel early.
    """
    _require(num_stages >= 2 and num_microbatches >= 1,
             f"the U-shape needs P >= 2 stages (edge + cloud) and m >= 1, got P={num_stages}, "
             f"m={num_microbatches}")
    p, m = num_stages, num_microbatches
    _require(backward_ratio > 0, f"backward_ratio must be > 0, got {backward_ratio}")
    _require(isinstance(prefetch, int) and prefetch >= 0,
             f"prefetch must be an integer >= 0, got {prefetch!r}")
    warmups = [p + 2 * prefetch] + [p - s + prefetch for s in range(1, p)] + [0]
    logical = {s: _one_f_one_b_stage(s, min(w, m), m, Op.F, Op.B) for s, w in enumerate(warmups)}
    schedule: Schedule = {0: _merge_edge(logical, p, Fraction(backward_ratio), prefetch)}
    for s in range(1, p):
        schedule[s] = logical[s]
    return schedule


def _merge_edge(logical: Schedule, p: int, backward_ratio: Fraction,
                latency: int = 0) -> list[Action]:
    """Merge logical stages 0 (start chunk) and P (end chunk) of a (P+1)-stage 1F1B into stage 0,
    played with ``latency`` (in cloud forwards) on the links to and from the edge."""
    backward: int | Fraction = backward_ratio
    if backward_ratio.denominator == 1:
        backward = backward_ratio.numerator  # integers play faster than Fractions, same order

    def cost(action: Action) -> int | Fraction:
        return 1 if action.op is Op.F else backward

    slow = {(0, 1), (1, 0), (p - 1, p), (p, p - 1)}

    def comm(send: Action) -> int:
        return latency if (send.stage, send.peer) in slow else 0

    played = simulate(lower(logical, "1f1b"), duration=cost, comm_time=comm)
    start = {(e.stage, e.action.op, e.action.mb): e.start for e in played.events if e.action.is_compute}
    units: list[tuple[tuple[float, int, int], list[Action]]] = []
    for a in logical[0]:
        op = Op.FS if a.op is Op.F else Op.BE
        units.append(((start[(0, a.op, a.mb)], _EDGE_RANK[op], a.mb), [Action(0, op, a.mb)]))
    for a in logical[p]:
        if a.op is Op.F:  # the (FE, BS) pair of this micro-batch, keyed by FE's start
            key = (start[(p, Op.F, a.mb)], _EDGE_RANK[Op.FE], a.mb)
            units.append((key, [Action(0, Op.FE, a.mb), Action(0, Op.BS, a.mb)]))
    units.sort(key=lambda unit: unit[0])
    return [action for _, unit in units for action in unit]


def forwards_of(schedule: Schedule) -> Schedule:
    """The forward actions of a compute-only schedule, in their order (evaluation: no grads).

    Why derived, not generated anew: every stage's list is a subsequence of a deadlock-free
    list, and dropping the backwards only removes dependencies, so no wait cycle can appear;
    the edge keeps the FS/FE interleaving the training schedule chose (``check_schedule`` still
    runs on the lowered result)."""
    return {s: [a for a in actions if a.op in FORWARD_OPS] for s, actions in schedule.items()}


def lower(schedule: Schedule, kind: str, prefetch: int = 0) -> Schedule:
    """Add communication to a compute-only schedule (pure: returns a new schedule).

    Rules: each SEND directly follows the compute producing it; each WAIT directly precedes the
    compute consuming it; the first RECV on an incoming channel is posted at the start of the
    list, and the next one right after the WAIT of the previous message on that channel (so every
    channel has at most one receive outstanding, which keeps buffers bounded and matching FIFO).
    Posting a receive never blocks, so early posting cannot add a deadlock.

    ``prefetch`` (U-shape): channels to and from the edge keep ``1 + 2 * prefetch`` receives
    outstanding, as many messages as :func:`u_shape` with that ``prefetch`` can send ahead, so
    they cross a slow link as soon as they are sent (gloo moves a message only once its receive
    is posted).
    """
    _require(kind in KINDS, f"unknown schedule kind {kind!r}; use one of {KINDS}")
    num_stages = len(schedule)
    _require(sorted(schedule) == list(range(num_stages)),
             f"stages must be 0..{num_stages - 1}, got {sorted(schedule)}")
    _require(prefetch >= 0, f"prefetch must be >= 0, got {prefetch}")
    ahead = 1 + 2 * prefetch if kind == "ushape" else 1
    return {s: _lower_stage(schedule[s], s, num_stages, kind, ahead) for s in range(num_stages)}


def _lower_stage(actions: list[Action], stage: int, p: int, kind: str,
                 edge_ahead: int = 1) -> list[Action]:
    inputs = [(i, _input_channel(a, p, kind)) for i, a in enumerate(actions)]
    incoming: dict[Channel, list[int]] = {}  # channel -> micro-batches in consumption order
    for i, channel in inputs:
        if channel is not None:
            incoming.setdefault(channel, []).append(actions[i].mb)
    # receives kept outstanding per channel: edge_ahead on links touching the edge (stage 0)
    ahead = {ch: edge_ahead if 0 in ch[:2] else 1 for ch in incoming}
    lowered = [_comm(Op.RECV_F if ch[2] == "F" else Op.RECV_B, stage, mb, ch[0])
               for ch, mbs in incoming.items() for mb in mbs[:ahead[ch]]]
    position = {ch: 0 for ch in incoming}
    for (i, channel), action in zip(inputs, actions):
        if channel is not None:
            direction, src = channel[2], channel[0]
            lowered.append(_comm(Op.WAIT_F if direction == "F" else Op.WAIT_B, stage, action.mb, src))
            position[channel] += 1
            later = position[channel] + ahead[channel] - 1
            if later < len(incoming[channel]):
                nxt = incoming[channel][later]
                lowered.append(_comm(Op.RECV_F if direction == "F" else Op.RECV_B, stage, nxt, src))
        lowered.append(action)
        output = _output_channel(action, p, kind)
        if output is not None:
            lowered.append(_comm(Op.SEND_F if output[2] == "F" else Op.SEND_B, stage, action.mb,
                                 output[1]))
    return lowered


def _comm(op: Op, stage: int, mb: int, peer: int) -> Action:
    return Action(stage, op, mb, peer)


def _next_stage(stage: int, p: int, kind: str) -> int | None:
    """Where activations go after ``stage`` (U-shape: the last cloud stage wraps to the edge)."""
    if stage < p - 1:
        return stage + 1
    return 0 if kind == "ushape" else None


def _input_channel(action: Action, p: int, kind: str) -> Channel | None:
    """The channel carrying the input a compute action consumes, if any."""
    s, op = action.stage, action.op
    if op is Op.F:
        return (s - 1, s, "F") if s > 0 else None
    if op is Op.B:
        nxt = _next_stage(s, p, kind)
        return (nxt, s, "B") if nxt is not None else None
    if op is Op.FE:
        return (p - 1, 0, "F")
    if op is Op.BE:
        return (1, 0, "B")
    return None  # FS reads data, BS reads the loss computed in FE: both local


def _output_channel(action: Action, p: int, kind: str) -> Channel | None:
    """The channel a compute action's output leaves on, if any."""
    s, op = action.stage, action.op
    if op is Op.F:
        nxt = _next_stage(s, p, kind)
        return (s, nxt, "F") if nxt is not None else None
    if op is Op.B:
        return (s, s - 1, "B") if s > 0 else None
    if op is Op.FS:
        return (0, 1, "F")
    if op is Op.BS:
        return (0, p - 1, "B")
    return None  # FE feeds BS locally, BE ends the micro-batch


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
