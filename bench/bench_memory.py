"""The memory estimate against real allocations, the planner against the estimate, and what
recomputation costs (issue #24; docs/memory.md).

1. ``real``: for cpu_demo, cpu_vtp and cpu_vdp (gpt_tiny), with and without recomputation
   and sequence parallelism, every rank's estimate (``ldt.memory.estimate``: fake tensors)
   next to what the same config really allocated: each rank runs ``train_worker`` for two
   steps (the first creates the optimizer states, the second runs with them) inside torch's
   MemTracker in real mode (:class:`ldt.memory.measure.LivePeak`: the live bytes of every
   tensor storage of the process and their peak). The corpus is capped at 20 kB
   (``data.max_bytes``): the data stages hold it as int64 tokens, host memory the estimate
   leaves out.
2. ``planner``: the planner's analytic memory per stage (``ldt.plan.cost``) next to the
   estimate for the plans it makes for the shipped real-size models (flash attention, as the
   planner assumes).
3. ``recompute``: step time (median of steps 2-6, no tracker) and peak memory per rank with
   recomputation off and on (cpu_demo: full on the edge, selective on the cloud), and the
   planner's predictions for both (simulated iteration on the cpu_local inventory; memory).

``python -m bench.bench_memory`` runs all three and prints one JSON line; ``layers`` instead
prints the per-layer bytes tests/test_plan_cost.py holds the planner to.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from bench.common import emit

MIB, GIB = 2**20, 2**30
RECOMPUTE = {0: {"granularity": "full", "method": "uniform", "num_layers": 1},
             "*": {"granularity": "selective", "modules": ["core_attn", "layernorm"]}}
REAL_CASES = [  # (cluster, recompute, sequence parallel[, model: gpt_tiny])
    ("cpu_demo", False, False), ("cpu_demo", True, False), ("cpu_demo", False, True),
    ("cpu_demo", True, True), ("cpu_vtp", False, False), ("cpu_vtp", True, False),
    ("cpu_vtp", False, True), ("cpu_vtp", True, True), ("cpu_vdp", False, False),
    ("cpu_vdp", True, False),
    # MoE (8 experts, top 2): the estimate routes evenly, the real router as it learns
    ("cpu_demo", False, True, "qwen3_moe_tiny"), ("cpu_vtp", False, True, "qwen3_moe_tiny"),
]
PLANS = [  # (model, inventory, micro-batch size)
    ("llama_7b", "edge_one_card", 2), ("llama3_8b", "edge_one_card", 1),
    ("qwen2.5_7b", "a100_910b", 1), ("llama_7b", "a100_910b", 1),
    ("qwen2.5_32b", "a100_910b", 1),
    ("qwen3_30b_a3b", "a100_910b", 1),  # MoE: 128 experts a layer, ~190 s to estimate
]

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("ldt-memory's estimate / real allocation per rank: the worst deviation over every rank "
     "of cpu_demo, cpu_vtp, cpu_vdp and the MoE cases",
     "**{estimate_vs_real_worst:.1%}**", "within 10%"),
    ("planner's analytic memory / the estimate, per stage of the real-size plans: worst "
     "deviation", "**{planner_vs_estimate_worst:.1%}**", "within 10%"),
]


def config(cluster: str, recompute: bool = False, sp: bool = False, *extra: str) -> dict:
    from omegaconf import OmegaConf

    from ldt.hydra_app import compose

    over = [f"cluster={cluster}", "train.steps=2", "train.tensorboard=false",
            "data.max_bytes=20000", f"model.sequence_parallel={str(sp).lower()}", *extra]
    cfg = OmegaConf.to_container(compose(over), resolve=True)
    if recompute:
        for i, st in enumerate(cfg["cluster"]["stages"]):
            st["recompute"] = dict(RECOMPUTE.get(i, RECOMPUTE["*"]))
    return cfg


def measured_worker(rank: int, world: int, cfg: dict, run_dir: str) -> int:
    """Train inside MemTracker (real mode); the process's peak of live tensor bytes, the
    corpus left out (a data stage holds it as int64 tokens in host memory: 160000 bytes at
    ``data.max_bytes=20000``, which a device's memory never holds and the estimate does not
    count; the tracker sees its storage at the first slice of a batch)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    from ldt.data.bytes import TextData
    from ldt.memory.measure import LivePeak
    from ldt.training.loop import train_worker

    corpus: list = []
    init = TextData.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        corpus.extend(get_untyped_storages(self.tokens))

    class DeviceOnly(LivePeak):
        def current(self) -> int:
            return super().current() - sum(st.nbytes() for st in corpus if st in self._WINFO)

    TextData.__init__ = keep
    tracker = DeviceOnly()
    with tracker:
        train_worker(rank, world, cfg, run_dir)
    return tracker.peak()


def timed_worker(rank: int, world: int, cfg: dict, run_dir: str):
    from ldt.training.loop import train_worker

    return train_worker(rank, world, cfg, run_dir)


def real_allocations() -> list[dict]:
    from ldt.launch import run_local_world
    from ldt.memory import estimate
    from ldt.validate import validate

    rows = []
    for cluster, rc, sp, *model in REAL_CASES:
        cfg = config(cluster, rc, sp, *[f"model={m}" for m in model])
        topo = validate(cfg["cluster"], cfg["model"], check_devices=False)
        stages = estimate(cfg)
        cfg["run_dir"] = tempfile.mkdtemp(prefix="ldt-bench-memory-")
        peaks = run_local_world(topo.world_size, measured_worker, (cfg, cfg["run_dir"]),
                                timeout_s=600)
        for rank, real in enumerate(peaks):
            st = stages[topo.rank_info(rank).stage]
            rows.append({"cluster": cluster, "model": (model or ["gpt_tiny"])[0],
                         "recompute": rc, "sp": sp, "rank": rank,
                         "stage": st.name, "estimate_mib": st.peak / MIB,
                         "real_mib": real / MIB, "ratio": st.peak / real})
            print(f"{cluster:9s} {(model or ['gpt_tiny'])[0]:14s} recompute={str(rc):5s} "
                  f"sp={str(sp):5s} rank {rank} "
                  f"({st.name:6s}): estimate {st.peak / MIB:7.3f} MiB, real {real / MIB:7.3f} "
                  f"MiB, estimate/real {st.peak / real:.3f}", flush=True)
    return rows


def planner_vs_estimate() -> list[dict]:
    from ldt.memory import estimate
    from ldt.plan import Workload, cluster_dict, load_inventory, load_model, plan

    rows = []
    for model_name, inv_name, mbs in PLANS:
        inventory, model = load_inventory(inv_name), load_model(model_name)
        best = plan(inventory, model, Workload(mbs, 64)).best
        p = best.plan
        cfg = {"cluster": cluster_dict(p, inventory), "model": _plain_model(model),
               "train": {"micro_batch_size": mbs, "num_microbatches": p.num_microbatches,
                         "prefetch": p.prefetch}, "data": {}}
        t0 = time.perf_counter()
        stages = estimate(cfg, attention="flash")
        seconds = time.perf_counter() - t0
        for report, est in zip(best.stages, stages):
            ratio = report.memory.total / est.peak
            rows.append({"model": model_name, "inventory": inv_name, "stage": report.name,
                         "recompute": est.recompute, "planner_gib": report.memory.total / GIB,
                         "estimate_gib": est.peak / GIB, "ratio": ratio,
                         "estimate_s": seconds})
            print(f"{model_name:11s} {inv_name:13s} {report.name:12s} {est.recompute:26s} "
                  f"planner {report.memory.total / GIB:6.2f} GiB, estimate {est.peak / GIB:6.2f}"
                  f" GiB, planner/estimate {ratio:.3f} (estimated in {seconds:.1f} s)",
                  flush=True)
    return rows


def _plain_model(model) -> dict:
    import dataclasses

    return dataclasses.asdict(model)


def recompute_cost(reps: int = 2) -> list[dict]:
    """cpu_demo (gpt_tiny) and the same with llama_tiny, recomputation off / on."""
    from ldt.launch import run_local_world
    from ldt.memory import estimate
    from ldt.plan import load_inventory, simulate_plan
    from ldt.plan.convert import cluster_to_plan
    from ldt.plan.cost import CostModel, Recompute
    from ldt.validate import validate
    from dataclasses import replace

    from ldt.config import to_cluster, to_model

    rows = []
    inventory = load_inventory("cpu_local")
    for model in ("gpt_tiny", "llama_tiny"):
        for rc in (False, True):
            cfg = config("cpu_demo", rc, False, f"model={model}", "train.steps=6")
            topo = validate(cfg["cluster"], cfg["model"], check_devices=False)
            times = []
            for _ in range(reps):
                run_dir = tempfile.mkdtemp(prefix="ldt-bench-memory-")
                out = run_local_world(topo.world_size, timed_worker, (cfg, run_dir),
                                      timeout_s=600)
                times.append(next(r for r in out if r is not None)["step_time_s"])
            stages = estimate(cfg)
            cluster, m = to_cluster(cfg["cluster"]), to_model(cfg["model"])
            p = cluster_to_plan(cluster, m, inventory, cfg["train"]["num_microbatches"],
                                kinds=["cpu_core"] * len(cluster.stages))
            if rc:
                p = replace(p, recompute=tuple(Recompute.of(st.recompute)
                                               for st in cluster.stages))
            cost = CostModel(m, inventory, cfg["train"]["micro_batch_size"],
                             flash_attention=False)
            ev = simulate_plan(p, cost)
            row = {"model": model, "recompute": rc, "step_time_s": statistics.median(times),
                   "predicted_iteration_s": ev.iteration_time,
                   "stages": [{"stage": e.name, "estimate_activations_mib":
                               e.activation_bytes / MIB, "estimate_peak_mib": e.peak / MIB,
                               "planner_activations_mib": r.memory.activations / MIB,
                               "planner_total_mib": r.memory.total / MIB}
                              for e, r in zip(stages, ev.stages)]}
            rows.append(row)
            print(f"{model:10s} recompute={str(rc):5s} step {row['step_time_s'] * 1e3:7.1f} ms "
                  f"(planner {ev.iteration_time * 1e3:7.1f} ms); per stage activations "
                  "estimate / planner MiB: " + ", ".join(
                      f"{s['stage']} {s['estimate_activations_mib']:.2f} / "
                      f"{s['planner_activations_mib']:.2f}" for s in row["stages"]), flush=True)
    return rows


def layers() -> None:
    """Per-layer bytes of the two families of tests/test_plan_cost.py (a 2-layer chunk minus a
    1-layer chunk of a middle stage)."""
    import itertools

    from ldt.memory import estimate

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_plan_cost import FAMILIES

    def cfg(model, tp, layout):
        return {"cluster": {"stages": [{"name": f"s{i}", "device": "cpu", "tp": t}
                                       for i, t in enumerate([1, tp, 1])],
                            "u_shape": False, "layout": layout, "dp": 1},
                "model": model, "train": {"micro_batch_size": 1, "num_microbatches": 3},
                "data": {}}

    for family, dtype, tp, attention in itertools.product(
            FAMILIES, ("bfloat16", "float32"), (1, 2), ("local", "flash")):
        for sp in (False, True) if tp > 1 else (False,):
            model = dict(FAMILIES[family], params_dtype=dtype, sequence_parallel=sp)
            one = estimate(cfg(model, tp, "Et|t|ttL"), attention=attention)[1]
            two = estimate(cfg(model, tp, "Et|tt|tL"), attention=attention)[1]
            print((family, dtype, tp, sp, attention, None), two.activations[0] -
                  one.activations[0], flush=True)


def main() -> dict:
    t0 = time.perf_counter()
    real = real_allocations()
    planned = planner_vs_estimate()
    cost = recompute_cost()
    worst_real = max(abs(r["ratio"] - 1) for r in real)
    worst_plan = max(abs(r["ratio"] - 1) for r in planned)
    print(f"estimate vs real allocation: worst {worst_real:.1%} over {len(real)} ranks; "
          f"planner vs estimate: worst {worst_plan:.1%} over {len(planned)} stages "
          f"({time.perf_counter() - t0:.0f} s)")
    return emit({"bench": "memory", "estimate_vs_real_worst": worst_real,
                 "planner_vs_estimate_worst": worst_plan, "real": real, "planner": planned,
                 "recompute": cost})


if __name__ == "__main__":
    if sys.argv[1:] == ["layers"]:
        layers()
    else:
        main()
