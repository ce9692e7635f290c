"""What a run leaves in its folder: ``metrics.csv``, ``action_times.csv``, the measured timeline,
and the progress bar on the reporting rank."""

from __future__ import annotations

import csv
import os
import socket
from types import SimpleNamespace
from typing import Any

REPORT_KEYS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "eval_loss")
# action_times.csv (ldt runtime only): every action of every step and stage; start_s / end_s are
# relative to that stage's step start, which is step_start_s on the clock of `host`.
ACTION_TIMES_KEYS = ("step", "stage", "action", "start_s", "end_s", "host", "step_start_s")


def progress_bar(total: int, enabled: bool):
    """tqdm on the reporting rank only (a disabled tqdm still allocates a process lock)."""
    if not enabled:
        return SimpleNamespace(update=lambda n: None, set_postfix=lambda **kw: None,
                               close=lambda: None)
    import threading

    from tqdm import tqdm

    # a thread lock: tqdm's default multiprocessing lock would outlive this worker's os._exit
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc="ldt-train", unit="step", dynamic_ncols=True, mininterval=0.5)


def gather_timings(timings, state):
    """Every stage leader's host and measured per-action times of every step (for the loss
    leader). Step starts are ``perf_counter`` values: one clock for all processes of a host
    (Linux CLOCK_MONOTONIC), so stages on one host can be lined up against each other."""
    import torch.distributed as dist

    if not state.is_leader or state.leader_group is None:
        return None
    gathered: list[Any] = [None] * state.topology.num_stages
    dist.all_gather_object(gathered, (socket.gethostname(), timings), group=state.leader_group)
    return gathered  # [stage] -> (host, [step] -> (step_start, [(action, start_s, end_s)]))


def write_outputs(run_dir: str, rows: list, timeline, topo) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REPORT_KEYS)
        w.writeheader()
        w.writerows(rows)
    if timeline:
        from ldt.schedule.timeline import (median_step, result_from_measurements,
                                           to_chrome_trace, to_png)

        with open(os.path.join(run_dir, "action_times.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(ACTION_TIMES_KEYS)
            for stage, (host, steps) in enumerate(timeline):
                for i, (step_start, step_rows) in enumerate(steps):
                    w.writerows((rows[i]["step"], stage, a, s, e, host, step_start)
                                for a, s, e in step_rows)
        one_clock = len({host for host, _ in timeline}) == 1  # else stages' starts don't compare
        i = median_step([steps for _, steps in timeline], one_clock)
        shown = [steps[i] for _, steps in timeline]  # per stage: (step start, rows)
        offsets = [start - min(s for s, _ in shown) for start, _ in shown] if one_clock else None
        result = result_from_measurements([step_rows for _, step_rows in shown], offsets)
        names = [stage.name for stage in topo.stages]
        to_chrome_trace(result, os.path.join(run_dir, "timeline.json"), stage_names=names)
        to_png(result, os.path.join(run_dir, "timeline.png"),
               f"measured step {rows[i]['step']} (the median of {len(rows)} steps), "
               f"{topo.num_stages} stages, TP {topo.tp_sizes}", stage_names=names)
