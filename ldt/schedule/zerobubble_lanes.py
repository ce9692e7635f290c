"""Zero-bubble schedules for lanes (per-stage DP): each lane's order kept, each backward split.

ZB-H1 (Qi et al., ICLR'24) is 1F1B with every backward split into B (the input's gradient, which
the previous stage waits for) and W (the weights' gradient, which nobody waits for), the W's
moved into the slots where a stage would otherwise wait: the B chain back through the pipeline
gets shorter by every W and the cool-down's waits fill with W's, at 1F1B's activation memory.

With per-stage DP the lists are per lane (:mod:`ldt.schedule.vdp`: a replica serving several
downstream replicas in turn, fan-out and fan-in). The list scheduler of
:mod:`ldt.schedule.zerobubble` plays one chunk per stage and could not route; here the lane
lists' forwards, backwards and messages stay as generated (1F1B per lane, or the VDP U-shape,
with its prefetch) and only the W's are placed, by a play of the lowered lists in time with
the run's prices (the simulator's: an action starts when its lane is free and, after a WAIT,
when the message has arrived, sent at the SEND's time plus its transfer):

* a backward runs first its W store's oldest W when the store is full;
* a WAIT that would block runs W's first: any (``fill="idle"``), or only those that end before
  the message is known to arrive (``fill="fit"``);
* what is left runs at the list's end.

Both fills are played at two W store sizes, and the lists with each W right after its backward
(timed exactly as the unsplit lists); the fastest by the simulator is kept. With one replica
per stage and F = B = W this is the paper's ZB-H1 (``3m + P - 1`` for m >= P); on uneven costs
the list scheduler, free to reorder forwards and backwards, is mostly faster
(docs/zero_bubble.md). A W consumes and sends nothing, so the lists' messages are those of the
unsplit lists that the checker passed: deadlock-free by construction, checked again anyway.
No torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ldt.schedule.check import check_schedule
from ldt.schedule.ir import W_OF, Action, LaneSchedule, Op, SEND_OPS
from ldt.schedule.simulate import prepare, simulate

_WAITS = (Op.WAIT_F, Op.WAIT_B)
FILLS = ("idle", "fit")


def split_backwards(lowered: LaneSchedule, duration: Callable[[Action], float],
                    comm_time: Callable[[Action], float]) -> LaneSchedule:
    """``lowered`` (checked lane lists, backwards unsplit) with every backward followed, later,
    by its W; ``duration`` prices a compute action (a backward: its B part; a W: its own),
    ``comm_time`` a SEND. Of :func:`played`, the fastest, then the smallest W store."""

    def score(schedule: LaneSchedule) -> tuple:
        sim = simulate(schedule, duration, comm_time)
        return sim.iteration_time, max(sim.peak_wstore.values(), default=0)

    best = min(played(lowered, duration, comm_time), key=score)
    check_schedule(best)
    return best


def played(lowered: LaneSchedule, duration: Callable[[Action], float],
           comm_time: Callable[[Action], float]) -> list[LaneSchedule]:
    """The candidate lists: each W right after its backward, then each fill played with the
    W store's cap per lane (the most backwards whose W has not run) at two sizes: the
    micro-batches the lane holds activations of at its peak (both chunks' peaks on an edge
    lane, as the simulator counts them), and the most any lane holds (as the uniform
    zero-bubble schedules' default)."""
    today = prepare(lowered)  # checked; its matching and the activations each lane holds
    held = {lane: max(1, today.peak_inflight[lane] + today.peak_inflight_end.get(lane, 0))
            for lane in lowered}
    most = {lane: max(held.values()) for lane in held}
    return [LaneSchedule(lists, lowered.microbatches) for lists in [_right_after(lowered)]
            + [_place(lowered, today.matches, duration, comm_time, caps, fill)
               for caps in (held, most) for fill in FILLS]]


def _right_after(lowered: LaneSchedule) -> dict[int, list[Action]]:
    return {lane: [x for a in acts for x in ([a, Action(lane, W_OF[a.op], a.mb)]
                                             if a.op in W_OF else [a])]
            for lane, acts in lowered.items()}


def _place(lowered: LaneSchedule, matches: dict, duration, comm_time, caps: dict[int, int],
           fill: str) -> dict[int, list[Action]]:
    """One play: the lowered lists with W's inserted where the rules above put them. The lane
    whose clock is earliest acts next, so a message not sent yet cannot arrive before it."""
    out = {lane: [] for lane in lowered}
    clock = {lane: 0.0 for lane in lowered}
    position = {lane: 0 for lane in lowered}
    store: dict[int, deque] = {lane: deque() for lane in lowered}  # W's to run, in B order
    arrives: dict[tuple, float] = {}  # SEND slot -> when its message arrives
    parked: dict[tuple, int] = {}  # SEND slot -> the lane blocked on it
    active = set(lowered)  # lanes neither blocked nor done

    def run_w(lane: int) -> None:
        w = store[lane].popleft()
        out[lane].append(w)
        clock[lane] += duration(w)

    while active:
        lane = min(active, key=lambda x: (clock[x], x))
        acts, i = lowered[lane], position[lane]
        if i == len(acts):  # the list's end: what the store still holds
            while store[lane]:
                run_w(lane)
            active.discard(lane)
            continue
        a = acts[i]
        if a.op in _WAITS:
            arrival = arrives.get(matches[(lane, i)])
            if arrival is None or arrival > clock[lane]:
                if store[lane] and (fill == "idle" or arrival is not None and
                                    arrival - clock[lane] >= duration(store[lane][0])):
                    run_w(lane)
                elif arrival is None:
                    parked[matches[(lane, i)]] = lane
                    active.discard(lane)
                else:
                    clock[lane] = arrival
                continue
        elif a.op in W_OF and len(store[lane]) >= caps[lane]:
            run_w(lane)  # the W store is full: its oldest W makes room
            continue
        out[lane].append(a)
        position[lane] += 1
        if a.op in SEND_OPS:
            arrives[(lane, i)] = clock[lane] + comm_time(a)
            if (lane, i) in parked:
                active.add(parked.pop((lane, i)))  # it decides again, at its own clock
        elif a.is_compute:
            clock[lane] += duration(a)
            if a.op in W_OF:
                store[lane].append(Action(lane, W_OF[a.op], a.mb))
    return out
