"""Helpers shared by the step-level benchmarks (VTP overhead, U-shape, calibration).

Kept small on purpose: building the same model chunk on every path, making the same batches,
timing a step between two barriers, and running ``ldt-train`` as a user would. Each bench
module still reads top to bottom on its own.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

SEED = 1234


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
    """Run ``python -m ldt.train`` as a user would; return its last-line JSON summary."""
    cmd = [sys.executable, "-m", "ldt.train", f"run_dir={run_dir}", *overrides]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
