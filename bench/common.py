"""Helpers shared by the step-level benchmarks (VTP overhead, U-shape, calibration).

Kept small on purpose: building the same model chunk on every path, making the same batches,
timing a step between two barriers, running ``ldt-train`` as a user would, and running either
of those with every rank on a host of its own CPU quota. Each bench module still reads top to
bottom on its own.

Hosts of their own CPU (:func:`run_on_hosts`, :func:`train_on_hosts`): on this machine's 2
shared cores a rank that waits lends its core to the busy ones, so two paths whose ranks are
not equally busy (ldt's fan-out keeps one sending process busy where megatron keeps two; a
pipeline's bubbles idle whole stages) are timed with different CPU, and an A/B ratio or a
calibration follows the machine's load more than the code (issue #45). Each rank runs in its
own network namespace with a cgroup CPU quota (``ldt.testing.hosts``), like a device of its
own; ``HOST_CPUS`` per rank leaves room for other work on the machine (a quota is a cap, not
a guarantee).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import torch

SEED = 1234
# cores per rank on hosts of their own CPU: 5 ranks x 0.3 = 1.5 of 2 cores (bench_vdp measured
# 0.45 x 4 letting other sessions' load starve the larger world); LDT_BENCH_CPUS overrides
HOST_CPUS = float(os.environ.get("LDT_BENCH_CPUS", "0.3"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median(values) -> float:
    return statistics.median(list(values))


def spread(values, digits: int = 4) -> dict:
    """Median, quartiles and range of repeated measurements (what an A/B figure reports)."""
    v = sorted(values)
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0],) * 3
    return {k: round(x, digits) for k, x in
            (("median", statistics.median(v)), ("q1", q1), ("q3", q3), ("min", v[0]),
             ("max", v[-1]))} | {"n": len(v)}


def machine_load() -> dict:
    """The machine's load averages (1, 5, 15 min) and core count: an A/B figure records the
    load it was measured under, because on a shared machine it moves every timing."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg": [round(one, 2), round(five, 2), round(fifteen, 2)],
            "cpus": os.cpu_count()}


def abba(run, paths: list[str], reps: int, warmup: int = 1) -> list[dict]:
    """A/B(/C) repetitions in one world: ``warmup`` rounds of every path first, discarded
    (allocator, autograd caches, gloo connections), then ``reps`` rounds whose order alternates
    (A B, B A, A B, ...), so drift in the machine's load hits every path alike. ``run(path)``
    returns one measurement; the result is one dict path -> measurement per kept round."""
    for _ in range(warmup):
        for path in paths:
            run(path)
    rounds = []
    for i in range(reps):
        order = paths if i % 2 == 0 else paths[::-1]
        rounds.append({path: run(path) for path in order})
    return rounds


def emit(out: dict, load_before: dict | None = None) -> dict:
    """Print the one JSON line ``bench.run_all`` collects and return it; with ``load_before``
    (:func:`machine_load` when the bench started) the load before and after is part of it."""
    if load_before is not None:
        out["load"] = {"before": load_before["loadavg"], "after": machine_load()["loadavg"],
                       "cpus": load_before["cpus"]}
    print(json.dumps(out))
    return out


def make_batches(model, micro_batch_size: int, m: int, seed: int = 7) -> list[dict]:
    """``m`` random micro-batches in the layout ``ldt.training.stage.make_forward_step`` reads."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, model.vocab_size, (micro_batch_size, model.seq_length + 1),
                               generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": torch.ones(micro_batch_size, model.seq_length),
                    "position_ids": torch.arange(model.seq_length).repeat(micro_batch_size, 1)})
    return out


def build_chunks(model, split, stage: int, tp: int, tp_rank: int, pg_collection=None,
                 vpp=None, num_stages: int = 1) -> list:
    """This stage's GPTModel chunks with ldt's layout-invariant weights.

    ``pg_collection=None`` builds against megatron-core's global ``parallel_state`` (its own
    uniform path); ldt passes its stage's groups. Same weights either way, so both paths run
    the identical model.
    """
    from ldt.models.init import init_chunk
    from ldt.models.build import build_chunk, global_param_name

    models = []
    for chunk in split.stage_chunks(stage):
        gpt = build_chunk(model, chunk, tp, vpp=vpp, num_stages=num_stages,
                          pg_collection=pg_collection)
        init_chunk(gpt, seed=SEED, num_layers=model.num_layers, tp=tp, tp_rank=tp_rank,
                   rename=lambda n, c=chunk: global_param_name(c, n))
        gpt.config.overlap_p2p_comm = False
        gpt.config.batch_p2p_comm = True
        models.append(gpt)
    return models


def zero_grads(models) -> None:
    for gpt in models:
        for p in gpt.parameters():
            p.grad = None


def timed_step(fn) -> float:
    """Wall time of ``fn()`` between two world barriers: the slowest rank's step."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def ldt_train(run_dir: str, overrides: list[str], timeout_s: float = 240) -> dict:
    """Run ``python -m ldt.job.train`` as a user would; return its last-line JSON summary."""
    cmd = [sys.executable, "-m", "ldt.job.train", f"run_dir={run_dir}", *overrides]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_times(run_dir: str) -> list[float]:
    """``step_time_s`` of every step of a run folder's metrics.csv but the first (warm-up)."""
    import csv

    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return [float(r["step_time_s"]) for r in csv.DictReader(f)][1:]


def schedule_spans(run_dir: str) -> tuple[list[float], dict]:
    """The schedule span of every step but the first (what the simulator's iteration models:
    no optimizer step), and how well the run's own calibrated replay explains it."""
    from ldt.plan.calibrate import compare, read_action_times, steady, step_spans

    rows = steady(read_action_times(os.path.join(run_dir, "action_times.csv")), 1)
    try:
        summary = compare(rows).summary()
    except ValueError as exc:  # e.g. steps that ran other action lists
        summary = {"error": float("nan"), "error_compute_only": float("nan"), "why": str(exc)}
    return list(step_spans(rows).values()), summary


def _check(results, argv) -> None:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        raise RuntimeError(f"{' '.join(map(str, argv))}: rank {bad[0].rank} failed "
                           f"({bad[0].returncode}):\n{bad[0].stderr[-3000:]}")


class CpuSamples(threading.Thread):
    """Each process's CPU seconds as the kernel counts them (user + system of all its threads,
    those that ended included: ``/proc/<pid>/stat``, in ticks of 1 / ``SC_CLK_TCK`` s), with
    ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for the machine's processes, that of
    ``action_times.csv``'s step starts), every ``every`` s
    until :meth:`stop`: a measure of a rank's CPU that shares no code with ldt."""

    TICK = 1 / os.sysconf("SC_CLK_TCK")

    def __init__(self, pids: list[int], every: float = 0.05):
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.samples: list[tuple[float, list[float]]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every):
            self.samples.append((time.perf_counter(), [self._cpu(pid) for pid in self.pids]))

    def stop(self) -> None:
        self._done.set()
        self.join()

    def _cpu(self, pid: int) -> float:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
        except OSError:  # it has exited
            return float("nan")
        return (int(fields[11]) + int(fields[12])) * self.TICK  # utime, stime

    def between(self, process: int, start: float, end: float) -> float:
        """CPU seconds process ``process`` (its index) used from ``start`` to ``end``
        (``perf_counter`` times), read at the samples nearest inside them (NaN if there are
        none)."""
        inside = [(t, cpu[process]) for t, cpu in self.samples if start <= t <= end]
        return inside[-1][1] - inside[0][1] if len(inside) > 1 else float("nan")


def train_on_hosts(run_dir: str, overrides: list[str], ranks: int, cpus: float = HOST_CPUS,
                   timeout_s: float = 600, cpu: Optional[list] = None) -> dict:
    """``ldt-train`` with one rank per host of ``cpus`` cores (started as torchrun starts
    ranks); returns the summary line its loss stage's leader printed. ``cpu``: a list that
    gets the run's :class:`CpuSamples` of the ranks' processes (in rank order)."""
    from ldt.testing.hosts import Hosts

    argv = [sys.executable, "-m", "ldt.job.train", f"run_dir={run_dir}", *overrides]
    with Hosts(ranks, cpus=cpus) as net:
        job = net.start(argv, [1] * ranks, cwd=ROOT, env={"PYTHONWARNINGS": "ignore"})
        sampler = None if cpu is None else CpuSamples(job.pids)
        if sampler is not None:
            sampler.start()
            cpu.append(sampler)
        try:
            results = job.wait(timeout_s)
        finally:
            if sampler is not None:
                sampler.stop()
    _check(results, argv)
    lines = [r.stdout.strip().splitlines()[-1] for r in results
             if r.stdout.strip().splitlines() and r.stdout.strip().splitlines()[-1][:1] == "{"]
    return json.loads(lines[0]) if lines else {}


def run_on_hosts(fn, args: tuple, ranks: int, cpus: float = HOST_CPUS,
                 timeout_s: float = 900) -> list:
    """``ldt.launch.local.run_local_world(ranks, fn, args)`` with every rank on a host of ``cpus``
    cores: ``fn(rank, world, *args)`` (a module-level function) runs in a gloo world joined
    as under torchrun; returns every rank's result, in rank order."""
    from ldt.testing.hosts import Hosts

    with tempfile.TemporaryDirectory(prefix="ldt-bench-hosts-") as tmp, \
            Hosts(ranks, cpus=cpus) as net:
        call = os.path.join(tmp, "call.pkl")
        module = fn.__module__
        if module == "__main__":  # a bench run as ``python -m bench.X``: the ranks import X
            module = sys.modules["__main__"].__spec__.name
        with open(call, "wb") as f:
            pickle.dump((module, fn.__qualname__, tuple(args)), f)
        argv = [sys.executable, "-m", "bench.common", "--host-rank", call, tmp]
        _check(net.start(argv, [1] * ranks, cwd=ROOT,
                         env={"PYTHONWARNINGS": "ignore"}).wait(timeout_s), argv)
        out = []
        for rank in range(ranks):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def _host_rank(call: str, folder: str) -> None:
    """One rank of :func:`run_on_hosts`: join the world torchrun's way, run, save the result."""
    from datetime import timedelta

    import torch.distributed as dist

    import ldt.launch.quiet  # noqa: F401  (as a launched rank: warnings off before megatron-core)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with open(call, "rb") as f:
        module, name, args = pickle.load(f)
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = fn(rank, world, *args)
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--host-rank":
        _host_rank(sys.argv[2], sys.argv[3])
