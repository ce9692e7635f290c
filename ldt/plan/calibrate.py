"""Calibrate the simulator with measured per-action times (``action_times.csv``).

When ldt's runtime runs, ``ldt-train`` records every action of every step and stage: computes,
receive and send posting, and waits, relative to the stage's step start, plus that start on the
host's clock. :func:`calibrate` turns a run into what :func:`ldt.schedule.simulate` needs (the
action lists the runtime executed, a time per (stage, op), and when each stage starts) and
:meth:`Calibration.predict` replays them. If the prediction matches the measured step, the
schedule model explains the run and the simulator (and the planner built on it) can be trusted
to rank layouts and schedules on that hardware; if not, the difference is what the model leaves
out.

What is measured, and why so:

* **Means, not medians.** A step's span is a sum of durations along its critical path, and its
  expectation is the sum of the expected durations. On a shared CPU (cpu_demo runs 4 ranks on 2
  cores) the durations have a long right tail (a rank descheduled for milliseconds); medians
  drop it and under-predicted cpu_demo by 12-17%.
* **A WAIT's own time** is measured from when it could first have returned: the later of the
  WAIT's start and the matching SEND's start, on the shared clock. That is the message's time on
  the wire plus a TP>1 stage's broadcast of what its leader received, not the time spent
  waiting for a peer that had not sent yet (the simulator works that out itself). So the
  replayed messages take zero time: their cost is the receiver's WAIT time.
* **Stage start offsets.** Stages leave the previous step's optimizer at different times (the
  loss stage also reports the loss); a stage that starts late delays its neighbours.

All of this compares times across processes, so every row must come from one host with its
step start recorded; :func:`calibrate` says so otherwise. The first steps are skipped
(:func:`steady`): they include allocator and autograd warm-up that a steady state does not pay.
"""

from __future__ import annotations

import csv
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ldt.config import ConfigError
from ldt.config.userfiles import not_a, path_kind
from ldt.schedule import Action, Op, Schedule, SimResult, parse_action, simulate
from ldt.schedule.check import ScheduleError, check_structure
from ldt.schedule.bounds import least_iteration
from ldt.schedule.ir import COMM_OPS, SEND_OPS, WAIT_OPS, num_microbatches

CostTable = dict[tuple[int, Op], float]
"""(stage, op) -> seconds."""


@dataclass(frozen=True)
class ActionTime:
    """One row of ``action_times.csv``."""

    step: int
    action: Action
    start_s: float
    end_s: float
    host: str = ""
    step_start_s: float | None = None
    """The stage's step start on ``host``'s clock (None: not recorded, no cross-stage times)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def clock_start_s(self) -> float:
        return self.step_start_s + self.start_s

    @property
    def clock_end_s(self) -> float:
        return self.step_start_s + self.end_s


def read_action_times(path: str | os.PathLike[str]) -> list[ActionTime]:
    """Rows of an ``action_times.csv`` (a file, or a run folder holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "action_times.csv")
    if path_kind(path) not in ("file", "missing"):
        raise ConfigError(not_a(path, str(path), "file", "give an ldt-train run folder or its "
                                "action_times.csv"))
    lanes = os.path.join(os.path.dirname(path), "lane_times.csv")
    if not os.path.isfile(path) and os.path.isfile(lanes):
        path = lanes  # refused below, saying why
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: ldt-train writes action_times.csv into its run_dir when "
            "ldt's runtime runs the pipeline (the U-shape, or train.runtime=ldt)")

    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if "lane" in (reader.fieldnames or ()):
            raise ConfigError(f"{path} times the lanes (stage replicas) of a per-stage DP "
                              "run, where the simulator's calibration takes one timeline per "
                              "stage; give a run of one replica per stage")
        missing = {"step", "action", "start_s", "end_s"} - set(reader.fieldnames or ())
        if missing:
            raise ConfigError(f"{path}: no {', '.join(sorted(missing))} column in its header; "
                              "give the action_times.csv an ldt-train run wrote")
        for r in reader:
            try:
                row = ActionTime(int(r["step"]), parse_action(r["action"]),
                                 float(r["start_s"]), float(r["end_s"]), r.get("host") or "",
                                 float(r["step_start_s"]) if r.get("step_start_s") else None)
                _check_row(row)
            except (TypeError, ValueError, AttributeError) as exc:
                raise ConfigError(
                    f"{path}:{reader.line_num}: a damaged row ({exc}): the file is truncated "
                    "or edited; give the action_times.csv of a run that finished") from None
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no measured action; give the action_times.csv of a "
                          "run that finished a step")
    return rows


def _check_row(row: ActionTime) -> None:
    """What a run writes: a step >= 0, times that are finite, an action that starts at or
    after its stage's step start and ends no earlier than it starts (ValueError names the
    value)."""
    import math

    if row.step < 0:
        raise ValueError(f"step {row.step} < 0")
    for name in ("start_s", "end_s", "step_start_s"):
        value = getattr(row, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} {value} is not a finite number")
    if row.start_s < 0:
        raise ValueError(f"start_s {row.start_s} is before the step started")
    if row.end_s < row.start_s:
        raise ValueError(f"end_s {row.end_s} is before start_s {row.start_s}")


def steady(rows: Iterable[ActionTime], skip_steps: int) -> list[ActionTime]:
    """Rows of the steps after the first ``skip_steps`` (warm-up) steps of the run."""
    rows = list(rows)
    first = min((r.step for r in rows), default=0)
    return [r for r in rows if r.step >= first + skip_steps]


@dataclass(frozen=True)
class Calibration:
    """A measured run in the simulator's terms (seconds)."""

    schedule: Schedule
    """The action lists the runtime executed (read back from the rows, not regenerated)."""
    compute: CostTable
    """Mean time of every (stage, compute op)."""
    local: CostTable
    """Mean own time of every (stage, communication op): posting a RECV / SEND, and a WAIT from
    when its message could first have arrived to its return."""
    start_at: dict[int, float]
    """Mean time each stage starts its step after the earliest stage."""

    def predict(self, compute_only: bool = False) -> SimResult:
        """Replay the schedule; ``compute_only`` leaves out communication and start offsets
        (what a pure compute model would predict)."""
        if compute_only:
            return simulate(self.schedule, self._time)
        return simulate(self.schedule, self._time, local_time=self._time, start_at=self.start_at)

    def _time(self, action: Action) -> float:
        table = self.compute if action.is_compute else self.local
        return table[(action.stage, action.op)]

    def transfer_times(self) -> dict[tuple[int, int], float]:
        """Each boundary's transfer ``(sender, receiver)`` as the receiver's WAIT measured it
        (the forward's from the stage before, the backward's from the stage after; the mean
        of both where one peer sends both, P = 2)."""
        stages = len(self.schedule)
        waits: dict[tuple[int, int], list[float]] = defaultdict(list)
        for (b, op), t in self.local.items():
            if op in (Op.WAIT_F, Op.WAIT_B):
                waits[((b - 1 if op == Op.WAIT_F else b + 1) % stages, b)].append(t)
        return {pair: sum(ts) / len(ts) for pair, ts in waits.items()}

    def least_iteration(self) -> float:
        """The least iteration any order of these measured ops could take, each transfer
        as :meth:`transfer_times`, each stage's sends and waits at their own times and each
        stage starting at its offset, as :meth:`predict` replays them
        (:func:`ldt.schedule.bounds.least_iteration`): what no schedule of this run's actions
        goes below."""
        return least_iteration({(s, op.value): t for (s, op), t in self.compute.items()},
                               self.transfer_times(), len(self.schedule),
                               num_microbatches(self.schedule),
                               any(op == Op.FS for _, op in self.compute),
                               own={(s, op.value): t for (s, op), t in self.local.items()},
                               start_at=self.start_at)


def calibrate(rows: Iterable[ActionTime]) -> Calibration:
    """What the simulator needs from a run's (steady) rows; see the module docstring."""
    rows = _on_one_clock(rows)
    by_step: dict[int, list[ActionTime]] = defaultdict(list)
    for r in rows:
        by_step[r.step].append(r)
    schedule = _action_lists(by_step[min(by_step)])

    try:  # rows a run wrote form its schedule; rows of two runs, or edited ones, may not
        check_structure(schedule)
    except ScheduleError as exc:
        raise ValueError(f"the rows of step {min(by_step)} are not a schedule a run executes "
                         f"({str(exc).splitlines()[0]}): the file holds edited rows or the "
                         "rows of more than one run") from None
    for step, step_rows in by_step.items():
        if _action_lists(step_rows) != schedule:
            raise ValueError(f"step {step} ran other action lists than step {min(by_step)}; "
                             "calibrate on steps of one run with one schedule")
    sent = {(r.step, r.action.channel, r.action.mb): r.clock_start_s
            for r in rows if r.action.op in SEND_OPS}
    samples: dict[tuple[int, Op], list[float]] = defaultdict(list)
    for r in rows:
        if r.action.op in WAIT_OPS:
            arrival_bound = max(r.clock_start_s, sent[(r.step, r.action.channel, r.action.mb)])
            samples[(r.action.stage, r.action.op)].append(r.clock_end_s - arrival_bound)
        else:
            samples[(r.action.stage, r.action.op)].append(r.duration_s)
    means = {key: statistics.fmean(values) for key, values in samples.items()}
    offsets: dict[int, list[float]] = defaultdict(list)
    for step_rows in by_step.values():
        starts = {r.action.stage: r.step_start_s for r in step_rows}
        for stage, start in starts.items():
            offsets[stage].append(start - min(starts.values()))
    return Calibration(schedule=schedule,
                       compute={k: v for k, v in means.items() if k[1] not in COMM_OPS},
                       local={k: v for k, v in means.items() if k[1] in COMM_OPS},
                       start_at={s: statistics.fmean(v) for s, v in sorted(offsets.items())})


def step_spans(rows: Iterable[ActionTime]) -> dict[int, float]:
    """Per step, from the earliest stage's step start to the last action's end (host clock):
    what :meth:`Calibration.predict`'s ``iteration_time`` models. It leaves out the gradient
    all-reduce / norm / optimizer step after the schedule, which ``metrics.csv``'s
    ``step_time_s`` includes."""
    first: dict[int, float] = {}
    last: dict[int, float] = defaultdict(float)
    for r in _on_one_clock(rows):
        first[r.step] = min(first.get(r.step, r.step_start_s), r.step_start_s)
        last[r.step] = max(last[r.step], r.clock_end_s)
    return {step: last[step] - first[step] for step in first}


def _action_lists(step_rows: list[ActionTime]) -> Schedule:
    per_stage: dict[int, list[ActionTime]] = defaultdict(list)
    for r in step_rows:
        per_stage[r.action.stage].append(r)
    return {stage: [r.action for r in sorted(seq, key=lambda r: r.start_s)]
            for stage, seq in sorted(per_stage.items())}


def _on_one_clock(rows: Iterable[ActionTime]) -> list[ActionTime]:
    rows = list(rows)
    if not rows:
        raise ValueError("no action times: was the run made on ldt's runtime (the U-shape, or "
                         "train.runtime=ldt) with more steps than were skipped?")
    hosts = sorted({r.host for r in rows})
    if len(hosts) > 1 or any(r.step_start_s is None for r in rows):
        raise ValueError(
            f"calibration compares stages' times, so it needs them on one clock; these rows come "
            f"from hosts {hosts} and step starts are "
            f"{'missing' if any(r.step_start_s is None for r in rows) else 'recorded'}. "
            "Calibrate on a single-host run of this version of ldt-train.")
    return rows


@dataclass(frozen=True)
class Comparison:
    """A run's measured schedule span against both predictions (``ldt-sim --measured``)."""

    steps: int
    measured_s: float
    """Median over the steps of :func:`step_spans`."""
    calibration: Calibration
    compute_only: SimResult
    full: SimResult

    @property
    def error(self) -> float:
        return self.full.iteration_time / self.measured_s - 1

    @property
    def error_compute_only(self) -> float:
        return self.compute_only.iteration_time / self.measured_s - 1

    def summary(self) -> dict:
        """JSON-ready figures, times in ms."""
        def ms(table: dict) -> dict:
            return {(f"{k[0]}{k[1].value}" if isinstance(k, tuple) else k): round(v * 1e3, 3)
                    for k, v in sorted(table.items())}

        cal = self.calibration
        least, work = cal.least_iteration(), sum(self.full.busy.values())
        return {"steps": self.steps, "measured_ms": round(self.measured_s * 1e3, 3),
                "predicted_ms": round(self.full.iteration_time * 1e3, 3),
                "error": round(self.error, 4),
                "predicted_compute_only_ms": round(self.compute_only.iteration_time * 1e3, 3),
                "error_compute_only": round(self.error_compute_only, 4),
                "bubble_fraction": round(float(self.full.bubble_fraction), 4),
                "least_ms": round(least * 1e3, 3),
                "bubble_least": round(1 - work / (len(self.full.busy) * least), 4),
                "busy_ms": ms(self.full.busy), "start_at_ms": ms(cal.start_at),
                "compute_ms": ms(cal.compute), "comm_ms": ms(cal.local)}


def compare(rows: Iterable[ActionTime],
            measured: Iterable[ActionTime] | None = None) -> Comparison:
    """Calibrate on ``rows`` and replay against the median span of the ``measured`` steps:
    other steps or another run of the same config (a prediction), or by default ``rows``
    themselves (how well the schedule model explains the run it was calibrated on)."""
    rows = list(rows)
    measured = rows if measured is None else list(measured)
    cal = calibrate(rows)
    return Comparison(steps=len({r.step for r in measured}),
                      measured_s=statistics.median(step_spans(measured).values()),
                      calibration=cal, compute_only=cal.predict(compute_only=True),
                      full=cal.predict())
