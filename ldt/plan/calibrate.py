"""Calibrate the simulator with measured per-action times (``action_times.csv``).

When ldt's runtime runs, ``ldt-train`` writes every compute action's start/end per step and
stage (relative to that stage's step start). Feeding their per-(stage, op) medians back into
:func:`ldt.schedule.simulate` with the same lowered action lists answers "does the schedule
model explain the measured step?": if it does, the simulator (and the planner built on it) can
be trusted to rank layouts and schedules on that hardware; if not, the difference is the part
of a step the model leaves out (communication, contention, Python between actions).

Medians, not means: on a shared 2-core CPU a few actions are descheduled for milliseconds, and
one such outlier per step should not move the cost table. The first steps are skipped because
they include allocator and autograd warm-up that a steady state does not pay.
"""

from __future__ import annotations

import csv
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ldt.schedule import Action, Op, SimResult, lower, one_f_one_b, parse_action, simulate, u_shape

CostTable = dict[tuple[int, Op], float]
"""(stage, op) -> seconds."""


@dataclass(frozen=True)
class ActionTime:
    """One row of ``action_times.csv``."""

    step: int
    action: Action
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def read_action_times(path: str | os.PathLike[str]) -> list[ActionTime]:
    """Rows of an ``action_times.csv`` (a file, or a run folder holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "action_times.csv")
    with open(path, newline="") as f:
        return [ActionTime(int(r["step"]), parse_action(r["action"]), float(r["start_s"]),
                           float(r["end_s"])) for r in csv.DictReader(f)]


def steady(rows: Iterable[ActionTime], skip_steps: int) -> list[ActionTime]:
    """Rows of the steps after the first ``skip_steps`` (warm-up) steps of the run."""
    rows = list(rows)
    first = min((r.step for r in rows), default=0)
    return [r for r in rows if r.step >= first + skip_steps]


def median_durations(rows: Iterable[ActionTime]) -> CostTable:
    """Median duration of every (stage, compute op) over all its micro-batches and steps."""
    samples: dict[tuple[int, Op], list[float]] = defaultdict(list)
    for r in rows:
        if r.action.is_compute:
            samples[(r.action.stage, r.action.op)].append(r.duration_s)
    return {key: statistics.median(values) for key, values in samples.items()}


def step_spans(rows: Iterable[ActionTime]) -> dict[int, float]:
    """Per step, the latest compute end over all stages: the measured schedule span.

    This is what the simulator's ``iteration_time`` models (step start to last compute end);
    it leaves out the gradient all-reduce / norm / optimizer step that follow the schedule,
    which ``metrics.csv``'s ``step_time_s`` includes.
    """
    spans: dict[int, float] = defaultdict(float)
    for r in rows:
        spans[r.step] = max(spans[r.step], r.end_s)
    return dict(spans)


def stage_overheads(rows: Iterable[ActionTime], quantile: float = 0.25) -> dict[int, float]:
    """Per stage, the time it spends between two compute actions when it is not waiting.

    Between computes a stage posts receives, waits them (on a TP>1 stage that includes the
    leader's broadcast to the stage), posts sends and returns to Python: work the simulator
    does not see, since it only times compute and the link. A gap is that local overhead plus
    any wait for a neighbour; the lower ``quantile`` of a stage's gaps (over all steps) keeps
    the gaps where nothing was waited for. Stage clocks are not aligned across processes, so
    cross-stage (link) latency cannot be separated this way; it is folded in where it is on a
    stage's own path.
    """
    gaps: dict[int, list[float]] = defaultdict(list)
    for (_, stage), seq in _by_step_stage(rows).items():
        gaps[stage] += [b.start_s - a.end_s for a, b in zip(seq, seq[1:])]
    return {stage: _quantile(values, quantile) for stage, values in gaps.items()}


def start_offset(rows: Iterable[ActionTime]) -> float:
    """Median over steps of the earliest compute start (step start to first compute)."""
    firsts: dict[int, float] = {}
    for (step, _), seq in _by_step_stage(rows).items():
        firsts[step] = min(firsts.get(step, seq[0].start_s), seq[0].start_s)
    return statistics.median(firsts.values()) if firsts else 0.0


def with_overheads(table: CostTable, overheads: dict[int, float]) -> CostTable:
    """Every compute action of stage s also pays that stage's per-action overhead."""
    return {(stage, op): d + overheads.get(stage, 0.0) for (stage, op), d in table.items()}


def _by_step_stage(rows: Iterable[ActionTime]) -> dict[tuple[int, int], list[ActionTime]]:
    out: dict[tuple[int, int], list[ActionTime]] = defaultdict(list)
    for r in rows:
        if r.action.is_compute:
            out[(r.step, r.action.stage)].append(r)
    for seq in out.values():
        seq.sort(key=lambda r: r.start_s)
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def duration_fn(table: CostTable) -> Callable[[Action], float]:
    """A simulator ``duration`` from a cost table; a missing (stage, op) is an error."""

    def duration(action: Action) -> float:
        try:
            return table[(action.stage, action.op)]
        except KeyError:
            raise KeyError(f"no measured duration for {action.op.value} on stage {action.stage}; "
                           "was the run made with the same schedule kind and stages?") from None

    return duration


def lowered_schedule(kind: str, num_stages: int, num_microbatches: int):
    """The lowered action lists ldt's runtime executes (``kind``: ``ushape`` or ``1f1b``)."""
    compute = (u_shape if kind == "ushape" else one_f_one_b)(num_stages, num_microbatches)
    return lower(compute, kind)


def predict(kind: str, num_stages: int, num_microbatches: int, table: CostTable,
            comm_time_s: float = 0.0) -> SimResult:
    """Simulate one step with measured durations and a constant time per message."""
    return simulate(lowered_schedule(kind, num_stages, num_microbatches), duration_fn(table),
                    lambda _send: comm_time_s)
