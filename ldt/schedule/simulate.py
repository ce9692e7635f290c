"""Timed simulation of a lowered schedule under a cost model.

It answers "how long does an iteration take, where are the bubbles, how many micro-batches does
each stage hold" before any hardware is used, which is what the planner and the timeline need.
Message matching and the stage-against-stage play are ``check.py``'s (one model, not two): this
module only supplies durations and summarises the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from fractions import Fraction
from numbers import Rational

from ldt.schedule.check import Played, Price, Program, Slot, check_structure, compile_play, play
from ldt.schedule.ir import WEIGHT_OPS, Action, Op, Schedule

# Ops that open / close a micro-batch's stay on a stage (the activations it keeps alive); where
# a stage splits its backward, B..W is the stay in the W store (what the weights' gradient
# needs of it: the linear layers' inputs and output gradients).
_OPENS = {Op.F: "all", Op.FS: "all", Op.FE: "end"}
_CLOSES = {Op.B: "all", Op.BE: "all", Op.BS: "end"}


@dataclass(frozen=True)
class Event:
    """One action as it ran: a WAIT spans the time it was blocked, SEND/RECV take no time."""

    stage: int
    action: Action
    start: float
    end: float


class Events(Sequence):
    """A simulation's events in stage order, built on first use: a planner that prices hundreds
    of plans reads only the summary, and building an event per action was a third of its time."""

    def __init__(self, schedule: Schedule, played: Played) -> None:
        self._schedule, self._played = schedule, played

    @cached_property
    def _events(self) -> list[Event]:
        s, p = self._schedule, self._played
        return [Event(stage, action, start, end) for stage in sorted(s)
                for action, start, end in zip(s[stage], p.start[stage], p.end[stage])]

    def __getitem__(self, index):
        return self._events[index]

    def __iter__(self):
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)


@dataclass
class SimResult:
    """Summary of one simulated iteration (times are in the unit the cost model uses)."""

    iteration_time: float
    busy: dict[int, float]
    bubble_fraction: float
    peak_inflight: dict[int, int]
    """Max micro-batches whose forward ran and whose backward has not (edge: FS until BE)."""
    peak_inflight_end: dict[int, int]
    """Edge stages only: max micro-batches between FE and BS (the end chunk's activations)."""
    events: Sequence[Event] = field(repr=False)
    peak_wstore: dict[int, int] = field(default_factory=dict)
    """Stages that split the backward (W ops) only: max (micro-batch, chunk) pairs whose
    backward ran and whose W has not (the W store: deferred weight-gradient work held)."""

    @property
    def num_stages(self) -> int:
        return len(self.busy)


@dataclass(frozen=True, eq=False)
class Prepared:
    """A schedule checked once, to be timed many times under different costs (the planner prices
    hundreds of plans on a few schedules): its WAIT -> SEND matching, where its computes are,
    and its in-flight peaks, which depend on the action lists only."""

    schedule: Schedule
    matches: dict[Slot, Slot]
    computes: dict[int, list[int]]
    peak_inflight: dict[int, int]
    peak_inflight_end: dict[int, int]
    program: Program
    peak_wstore: dict[int, int] = field(default_factory=dict)


def prepare(schedule: Schedule) -> Prepared:
    """Check ``schedule``'s structure (raises ``ScheduleError``) and keep what timing reuses."""
    matches = check_structure(schedule)
    computes = {stage: [i for i, a in enumerate(actions) if a.is_compute]
                for stage, actions in schedule.items()}
    peak_all, peak_end, peak_wstore = _peak_inflight(schedule)
    return Prepared(schedule, matches, computes, peak_all, peak_end,
                    compile_play(schedule, matches), peak_wstore)


def simulate(
    schedule: Schedule | Prepared,
    duration: Price,
    comm_time: Price = lambda a: 0,
    local_time: Callable[[Action], float] | None = None,
    start_at: dict[int, float] | None = None,
    handshake: Callable[[Action], float] | None = None,
) -> SimResult:
    """Play a lowered schedule with ``duration(compute action)`` and ``comm_time(send action)``
    (or tables of them, :data:`ldt.schedule.check.Price`); ``local_time`` (communication
    actions' own time) and ``start_at`` (stage start offsets) are for replaying measurements,
    ``handshake`` models a rendezvous transport; see :func:`ldt.schedule.check.play`.

    Integer or ``fractions.Fraction`` costs give exact results. Raises ``ScheduleError`` on a
    malformed or deadlocking schedule, like ``check_schedule``; a :class:`Prepared` schedule
    skips the structural checks it already passed.
    """
    prepared = schedule if isinstance(schedule, Prepared) else prepare(schedule)
    schedule = prepared.schedule
    played = play(schedule, prepared.matches, duration, comm_time, local_time, start_at, handshake,
                  prepared.program)
    busy: dict[int, float] = {}
    for stage in sorted(schedule):
        starts, ends = played.start[stage], played.end[stage]
        busy[stage] = sum((ends[i] - starts[i] for i in prepared.computes[stage]), 0)
    # a stage's clock only moves forward, so its last action ends last
    iteration_time = max((ends[-1] for ends in played.end.values() if ends), default=0)
    capacity = len(schedule) * iteration_time
    work = sum(busy.values())
    if isinstance(work, Rational) and isinstance(capacity, Rational):
        work = Fraction(work)  # exact costs in, exact bubble out
    bubble = 1 - work / capacity if capacity else 0
    return SimResult(iteration_time, busy, bubble, dict(prepared.peak_inflight),
                     dict(prepared.peak_inflight_end), Events(schedule, played),
                     dict(prepared.peak_wstore))


def _peak_inflight(schedule: Schedule) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Walk each list counting micro-batches held: opened by F/FS (FE), closed by B/BE (BS);
    and, on a stage that runs W ops, the W store: opened by a backward, closed by its W."""
    peak_all: dict[int, int] = {}
    peak_end: dict[int, int] = {}
    peak_wstore: dict[int, int] = {}
    for stage, actions in schedule.items():
        ops = {a.op for a in actions}
        split = {b for w, b in WEIGHT_OPS.items() if w in ops}  # backwards deferring a W
        held = {"all": 0, "end": 0}
        peak = {"all": 0, "end": 0}
        store = top = 0
        for action in actions:
            if action.op in _OPENS:
                kind = _OPENS[action.op]
                held[kind] += 1
                peak[kind] = max(peak[kind], held[kind])
            elif action.op in _CLOSES:
                held[_CLOSES[action.op]] -= 1
            if action.op in split:
                store += 1
                top = max(top, store)
            elif action.op in WEIGHT_OPS:
                store -= 1
        peak_all[stage] = peak["all"]
        if Op.FE in ops:
            peak_end[stage] = peak["end"]
        if split:
            peak_wstore[stage] = top
    return peak_all, peak_end, peak_wstore


def compute_cost(costs: dict[Op, float], per_stage: dict[int, dict[Op, float]] | None = None
                 ) -> Callable[[Action], float]:
    """A ``duration`` function from a table ``{op: time}``, optionally overridden per stage."""
    overrides = per_stage or {}

    def duration(action: Action) -> float:
        table = overrides.get(action.stage, costs)
        if action.op not in table:
            raise KeyError(f"no cost for {action.op.value} on stage {action.stage}; add it to the "
                           "cost table")
        return table[action.op]

    return duration
