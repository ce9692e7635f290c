"""What a run leaves in its folder and shows while it runs: ``metrics.csv`` (a row per step,
appended as it happens), TensorBoard events, progress lines, ``action_times.csv`` and the
measured timeline, and the one-line JSON summary.

Everything here runs on the reporting rank (the loss stage's leader of replica 0).
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import sys
from typing import TYPE_CHECKING, Any, Optional

from ldt.boundary.lane_communicator import lane_of
from ldt.plan.cost import CostModel
from ldt.schedule.routing import Lanes
from ldt.schedule.timeline import median_step, result_from_measurements, to_chrome_trace, to_png
from ldt.storage.atomic import replacing

if TYPE_CHECKING:  # annotations only: the outputs need none of them at run time
    from ldt.config import LdtConfig
    from ldt.topology.ranks import Topology
    from ldt.training.guard import Decision

REPORT_KEYS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "eval_loss",
               "tflops_per_device", "mfu")
# action_times.csv (ldt runtime only): every action of every step and stage; start_s / end_s are
# relative to that stage's step start, which is step_start_s on the clock of `host`.
ACTION_TIMES_KEYS = ("step", "stage", "action", "start_s", "end_s", "host", "step_start_s")
# lane_times.csv, its per-stage DP twin: a row per action of every lane (stage replica), whose
# action strings name lanes (ldt.schedule.vdp), with the lane's stage and replica beside it
LANE_TIMES_KEYS = ("step", "lane", "stage", "replica", "action", "start_s", "end_s", "host",
                   "step_start_s")


def mtp_keys(num_mtp: int) -> list[str]:
    """metrics.csv's MTP-loss columns, one per MTP layer (megatron's ``mtp_<k> loss``)."""
    return [f"mtp_{k + 1}_loss" for k in range(num_mtp)]


def memory_keys(num_stages: int) -> list[str]:
    """metrics.csv's peak-memory columns, one per stage (the largest of its ranks)."""
    return [f"peak_mem_gib_stage{s}" for s in range(num_stages)]


class MetricsLog:
    """``metrics.csv``: one row per step, written and flushed as the step ends, so a killed
    run keeps its rows. Resuming at step N into the same folder keeps the rows before N and
    drops the later ones (they are trained again); a new run starts the file afresh."""

    def __init__(self, run_dir: str, keys: list[str], first_step: int):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.csv")
        kept, old_keys = [], []
        if first_step > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                old_keys = list(reader.fieldnames or [])
                kept = [r for r in reader if r.get("step", "").isdigit()
                        and int(r["step"]) < first_step]
        self.keys = list(keys) + [k for k in old_keys if k not in keys]
        self._file = None
        try:
            with replacing(self.path) as tmp:
                with open(tmp, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=self.keys, restval="")
                    w.writeheader()
                    w.writerows(kept)
                # opened before it is put in place: nothing can fail after the rows are gone
                self._file = open(tmp, "a", newline="")
        except BaseException:
            if self._file is not None:
                self._file.close()
            raise
        self._writer = csv.DictWriter(self._file, fieldnames=self.keys, restval="",
                                      extrasaction="ignore")

    def append(self, row: dict) -> None:
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoard:
    """Scalars of every step as TensorBoard events in the run folder (``tensorboard --logdir``
    on the folder or its parent). A resume purges the events from its first step on."""

    def __init__(self, run_dir: str, first_step: int, flush_every: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # a dependency of ldt, but an environment may lack it
            print("ldt-train: the tensorboard package is missing: no TensorBoard events "
                  "(pip install tensorboard, or train.tensorboard=false)", file=sys.stderr)
            self.writer = None
            return
        self.writer = SummaryWriter(log_dir=run_dir, purge_step=first_step or None)
        self.flush_every = max(1, flush_every)

    def add(self, row: dict) -> None:
        if self.writer is None:
            return
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                group = "memory" if key.startswith("peak_mem") else (
                    "eval" if key.startswith("eval") else "train")
                self.writer.add_scalar(f"{group}/{key}", value, step)
        if (step + 1) % self.flush_every == 0:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Console:
    """Progress on the terminal: tqdm's bar when stdout is a terminal; otherwise (a log file)
    one plain line every ``log_interval`` steps and after the last."""

    def __init__(self, first_step: int, steps: int, log_interval: int,
                 tty: Optional[bool] = None):
        self.steps, self.interval = steps, max(1, log_interval)
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.bar = None
        if self.tty:
            import threading

            from tqdm import tqdm

            # a thread lock: tqdm's default multiprocessing lock would outlive this worker's
            # os._exit
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=steps - first_step, desc="ldt-train", unit="step",
                            dynamic_ncols=True, mininterval=0.5)

    def update(self, row: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=_fmt(row["loss"], ".4f"),
                                 tok_s=_fmt(row["tokens_per_s"], ".0f"),
                                 step_s=_fmt(row["step_time_s"], ".3f"))
        elif (row["step"] + 1) % self.interval == 0 or row["step"] + 1 == self.steps:
            print(log_line(row, self.steps), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def log_line(row: dict, steps: int) -> str:
    """``step 10/50 | loss 4.6166 | lr 9.80e-04 | ...`` (peak memory per stage, GiB)."""
    mem = [row[k] for k in row if k.startswith("peak_mem_gib_stage")]
    parts = [f"step {row['step'] + 1}/{steps}", f"loss {_fmt(row['loss'], '.4f')}",
             f"lr {_fmt(row['lr'], '.2e')}", f"grad_norm {_fmt(row['grad_norm'], '.3f')}",
             f"{_fmt(row['tokens_per_s'], '.0f')} tok/s", f"{_fmt(row['step_time_s'], '.3f')} s/step"]
    if row.get("skipped"):
        parts.append(f"skipped: fp16 gradients overflowed at loss scale {row['loss_scale']:g}")
    if row.get("eval_loss") is not None:
        parts.append(f"eval_loss {_fmt(row['eval_loss'], '.4f')}")
    for key in (k for k in row if k.startswith("mtp_")):
        parts.append(f"{key} {_fmt(row[key], '.4f')}")
    if row.get("tflops_per_device") is not None:
        parts.append(f"{_fmt(row['tflops_per_device'], '.3g')} TFLOP/s/device")
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * row['mfu']:.1f}%")
    if mem:
        parts.append("peak mem " + "/".join(f"{m:.2f}" for m in mem) + " GiB")
    return "ldt-train: " + " | ".join(parts)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def model_flops_per_step(model, micro_batch_size: int, microbatches: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward, no recomputation),
    from the planner's cost model: the same formula that prices plans."""
    cost = CostModel(model, None, micro_batch_size)
    return 3.0 * microbatches * (model.num_layers * cost.layer_flops() + cost.head_flops())


def peak_flops(topo, peak_tflops: dict) -> Optional[float]:
    """The world's peak FLOP/s from ``train.peak_tflops`` (per device type, per device);
    None when a device type in the cluster has no entry."""
    total = 0.0
    for s in topo.stages:
        if s.device not in peak_tflops or not peak_tflops[s.device]:
            return None
        total += s.tp * topo.dp_of(s.index) * float(peak_tflops[s.device]) * 1e12
    return total


def parity_max_abs_diff(run: dict, ref: dict) -> float:
    """``train.verify``'s figure: the largest difference between the run's losses (and held-out,
    MTP and MoE load-balancing losses) and the single-process reference's, step by step. Two summaries that do not cover
    the same steps (first step, count of losses, count of held-out losses) have no parity:
    ValueError naming both counts, never a figure over the steps they happen to share."""
    for key in ("first_step", "steps"):
        if run.get(key) != ref.get(key):
            raise ValueError(f"train.verify: the run's {key} is {run.get(key)}, the "
                             f"reference's {ref.get(key)}; no parity between different steps")
    for key in ("losses", "eval_losses", "moe_aux_losses"):
        got, want = run.get(key, []), ref.get(key, [])
        if len(got) != len(want):
            raise ValueError(f"train.verify: the run reported {len(got)} {key}, the reference "
                             f"{len(want)} (steps {run.get('first_step')}..{run.get('steps')}); "
                             "no parity over a partial run")
    if not run.get("losses"):
        raise ValueError("train.verify: the run reported no losses; nothing to compare")
    if len(run.get("mtp_losses", [])) != len(ref.get("mtp_losses", [])):
        raise ValueError(f"train.verify: the run reported MTP losses for "
                         f"{len(run.get('mtp_losses', []))} steps, the reference for "
                         f"{len(ref.get('mtp_losses', []))}; no parity")
    mtp = [(a, b) for x, y in zip(run.get("mtp_losses", []), ref.get("mtp_losses", []))
           for a, b in zip(x, y)]
    pairs = [*zip(run["losses"], ref["losses"]),
             *zip(run.get("eval_losses", []), ref.get("eval_losses", [])),
             *zip(run.get("moe_aux_losses", []), ref.get("moe_aux_losses", [])), *mtp]
    return max(abs(a - b) for a, b in pairs)


def summary_json(summary: dict) -> str:
    """The summary line: valid JSON always (a NaN or an infinity becomes null)."""
    return json.dumps(_finite(summary), allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def gather_timings(timings, state):
    """Every stage leader's host and measured per-action times of every step (for the loss
    leader); with per-stage DP every lane's (stage replica's) leader's, every rank joining.
    Step starts are ``perf_counter`` values: one clock for all processes of a host (Linux
    CLOCK_MONOTONIC), so stages on one host can be lined up against each other."""
    import torch.distributed as dist

    if state.topology.is_vdp:  # no group holds just the lanes' leaders: the world's
        mine = (lane_of(state), socket.gethostname(), timings) if state.is_leader else None
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return [(host, steps) for _, host, steps in
                sorted((x for x in every if x is not None), key=lambda x: x[0])]
    if not state.is_leader or state.leader_group is None:
        return None
    gathered: list[Any] = [None] * state.topology.num_stages
    dist.all_gather_object(gathered, (socket.gethostname(), timings), group=state.leader_group)
    return gathered  # [stage or lane] -> (host, [step] -> (step_start, [(action, s, e)]))


def write_outputs(run_dir: str, rows: list, timeline, topo) -> None:
    """At the end: ``action_times.csv`` (per-stage DP: ``lane_times.csv``, a timeline per
    lane) and the measured timeline (metrics.csv is written as the run goes, by
    :class:`MetricsLog`)."""
    os.makedirs(run_dir, exist_ok=True)
    if timeline and rows:
        lanes = Lanes(tuple(topo.dp_sizes)) if topo.is_vdp else None
        # whole: ldt-sim --measured and train.cost_run read action_times.csv
        with replacing(os.path.join(run_dir, "lane_times.csv" if lanes else
                                    "action_times.csv")) as tmp, \
                open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(LANE_TIMES_KEYS if lanes else ACTION_TIMES_KEYS)
            for index, (host, steps) in enumerate(timeline):
                where = (index, *lanes.of(index)) if lanes else (index,)
                for i, (step_start, step_rows) in enumerate(steps):
                    w.writerows((rows[i]["step"], *where, a, s, e, host, step_start)
                                for a, s, e in step_rows)
        one_clock = len({host for host, _ in timeline}) == 1  # else stages' starts don't compare
        i = median_step([steps for _, steps in timeline], one_clock)
        shown = [steps[i] for _, steps in timeline]  # per stage: (step start, rows)
        offsets = [start - min(s for s, _ in shown) for start, _ in shown] if one_clock else None
        result = result_from_measurements([step_rows for _, step_rows in shown], offsets)
        names = ([f"{topo.stages[s].name} r{r}" for s, r in map(lanes.of, range(len(lanes)))]
                 if lanes else [stage.name for stage in topo.stages])
        rows_are = "lane" if lanes else "stage"
        with replacing(os.path.join(run_dir, "timeline.json")) as tmp:
            to_chrome_trace(result, tmp, stage_names=names, rows=rows_are)
        with replacing(os.path.join(run_dir, "timeline.png")) as tmp:
            to_png(result, tmp, f"measured step {rows[i]['step']} (the median of {len(rows)} "
                   f"steps), {topo.num_stages} stages, TP {topo.tp_sizes}"
                   + (f", dp {list(topo.dp_sizes)}" if lanes else ""), stage_names=names,
                   rows=rows_are)


class StepOutputs:
    """The reporting rank's outputs of every step: metrics.csv, TensorBoard, the console."""

    def __init__(self, cfg: LdtConfig, topo: Topology, run_dir: str, first_step: int,
                 moe_aux: bool = False):
        t = cfg.train
        self.memory_keys = memory_keys(topo.num_stages)
        aux = ["moe_aux_loss"] if moe_aux else []  # megatron's MoE auxiliary loss is tracked
        scaled = ["loss_scale", "skipped"] if cfg.model.params_dtype == "float16" else []
        self.metrics = MetricsLog(run_dir, [*REPORT_KEYS, *mtp_keys(cfg.model.mtp_num_layers),
                                            *aux, *scaled, *self.memory_keys], first_step)
        self.board = TensorBoard(run_dir, first_step, t.log_interval) if t.tensorboard else None
        self.console = Console(first_step, t.steps, t.log_interval)
        self.flops = model_flops_per_step(cfg.model, t.micro_batch_size,
                                          topo.dp * t.num_microbatches)
        self.peak = peak_flops(topo, t.peak_tflops)
        self.devices = topo.world_size

    def step(self, row: dict, decision: Decision) -> None:
        dt = row["step_time_s"]
        row["tflops_per_device"] = self.flops / dt / self.devices / 1e12
        row["mfu"] = self.flops / dt / self.peak if self.peak else None
        row.update(zip(self.memory_keys, decision.peak_memory_gib))
        self.metrics.append(row)
        if self.board is not None:
            self.board.add(row)
        self.console.update(row)

    def close(self) -> None:
        self.metrics.close()
        if self.board is not None:
            self.board.close()
        self.console.close()
