"""The memory estimate against what a run really holds, the planner against the estimate, and
what recomputation costs (issues #24, #45; docs/memory.md).

1. ``real``: for cpu_demo, cpu_vtp and cpu_vdp (gpt_tiny), with and without recomputation
   and sequence parallelism, and a MoE model (qwen3_moe_tiny) on cpu_demo and cpu_vtp, at the
   shipped size and scaled up (:data:`SCALED`: h 256, s 256), every rank's estimate
   (``ldt.memory.estimate``: fake tensors) next to two measures of the same config trained two
   steps (the first creates the optimizer states, the second runs with them):

   - ``tracker``: torch's MemTracker in real mode (:class:`ldt.memory.measure.LivePeak`, the
     live bytes of every tensor storage of the process): the method the estimate runs on fake
     tensors, so it checks the fake replay, not the method;
   - ``resident``: what the operating system counts, sharing no code with either
     (:mod:`bench.resident`): the peak of the process's anonymous resident memory from the
     moment its process groups exist to the last step's end, in a world started with glibc's
     mmap threshold, trim threshold and top pad pinned (:data:`bench.resident.MALLOC_ENV`:
     freed tensors leave the process). On a cuda stage it is the
     caching allocator's peak allocated and reserved bytes instead (not run here).

   Both leave out the corpus a data stage holds in host memory as int64 tokens (160000 bytes
   at ``data.max_bytes=20000``), which a device never holds and the estimate does not count.
2. ``planner``: the planner's analytic memory per stage (``ldt.plan.memory_cost``) next to the
   estimate for the plans it makes for the shipped real-size models (flash attention, as the
   planner assumes).
3. ``recompute``: step time (median of steps 2-6, no tracker) and peak memory per rank with
   recomputation off and on (cpu_demo: full on the edge, selective on the cloud), and the
   planner's predictions for both (simulated iteration on the cpu_local inventory; memory).

``python -m bench.bench_memory`` runs all three and prints one JSON line; ``real``,
``planner`` or ``recompute`` runs one of them (``real --size scaled --cluster cpu_vtp``: some
of its cases); ``merge FILE...`` makes one JSON line of the pieces' lines; ``layers`` prints
the per-layer bytes tests/test_plan_cost.py holds the planner to.
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
SCALED = {  # per model, the overrides of the "scaled" size: tensors of 0.5-1 MiB, where the
    # allocator's page rounding is small and Python's own memory a few percent of a rank's
    "gpt_tiny": ["model.hidden_size=256", "model.num_attention_heads=8",
                 "model.ffn_hidden_size=1024", "model.seq_length=256"],
    "qwen3_moe_tiny": ["model.hidden_size=256", "model.num_attention_heads=8",
                       "model.kv_channels=32", "model.ffn_hidden_size=512",
                       "model.moe_ffn_hidden_size=128", "model.seq_length=256"],
}
LATER_IMPORTS = [  # what training imports after its process groups exist: imported before the
    # resident baseline, so the modules' own memory is not counted as the run's
    "ldt.data", "ldt.data.bytes", "ldt.boundary.noise", "ldt.training.optim",
    "ldt.training.checkpoint", "ldt.training.moe", "ldt.training.observe",
    "ldt.pipeline.forward_backward", "ldt.boundary.communicator", "megatron.core.models.gpt",
    "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
]
PLANS = [  # (model, inventory, micro-batch size)
    ("llama_7b", "edge_one_card", 2), ("llama3_8b", "edge_one_card", 1),
    ("qwen2.5_7b", "a100_910b", 1), ("llama_7b", "a100_910b", 1),
    ("qwen2.5_32b", "a100_910b", 1),
    ("qwen3_30b_a3b", "a100_910b", 1),  # MoE: 128 experts a layer, ~190 s to estimate
]

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("ldt-memory's estimate / the tracker (torch's MemTracker on the real run) per rank, every "
     "rank of cpu_demo, cpu_vtp, cpu_vdp (recompute, SP on / off) and qwen3_moe_tiny; h 64 / "
     "h 256",
     "{real_summary[shipped][vs_tracker][min]:.3f}-{real_summary[shipped][vs_tracker][max]:.3f}"
     " / {real_summary[scaled][vs_tracker][min]:.3f}-{real_summary[scaled][vs_tracker][max]:.3f}"
     " ({real_summary[shipped][ranks]} + {real_summary[scaled][ranks]} ranks)", "within 10%"),
    ("the estimate / the process's resident peak over its baseline (glibc pinned; an independent "
     "measure), the same ranks, h 64 / h 256; resident minus estimate",
     "{real_summary[shipped][vs_resident][min]:.2f}-{real_summary[shipped][vs_resident][max]:.2f}"
     " / **{real_summary[scaled][vs_resident][min]:.2f}-{real_summary[scaled][vs_resident][max]"
     ":.2f}**; {real_summary[scaled][resident_minus_estimate_mib][min]:.1f}-"
     "{real_summary[shipped][resident_minus_estimate_mib][max]:.1f} MiB on every rank (not "
     "bounded on {real_summary[scaled][not_bounded]} + {real_summary[shipped][not_bounded]}: "
     "docs/memory.md)", "bounds from above within 10%"),
    ("planner's analytic memory / the estimate, per stage of the real-size plans (a piece of "
     "its own: `python -m bench.bench_memory planner`, 2026-11-28 05:33, 29f5ae3)",
     "**{planner_vs_estimate[min]:.3f}-{planner_vs_estimate[max]:.3f}** "
     "({planner_vs_estimate[n]} stages)", "within 10%"),
]


def config(cluster: str, recompute: bool = False, sp: bool = False, *extra: str) -> dict:
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose

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


def resident_worker(rank: int, world: int, cfg: dict, run_dir: str) -> dict:
    """Train with no tracker; the reference of the rank's device (:func:`bench.resident.
    for_device`) from the moment ``ldt.initialize_vtp`` returned (the modules training imports
    later imported first) to the last step's end (before the reporter draws its timeline).
    Returns the reference's figures, the corpus's bytes and whether glibc was pinned."""
    import importlib

    import ldt
    import ldt.training.loop as loop
    from bench.resident import for_device
    from ldt.data.bytes import TextData
    from ldt.training.loop import train_worker

    probe: list = []
    got: dict = {}
    corpus: list = []
    initialize, text_data = ldt.initialize_vtp, TextData.__init__

    def initialize_then_start(topo, *args, **kwargs):
        state = initialize(topo, *args, **kwargs)
        for name in LATER_IMPORTS:
            importlib.import_module(name)
        probe.append(for_device(topo.stages[state.stage].device))
        probe[0].start()
        return state

    def stop_first(func):
        def wrapped(*args, **kwargs):
            if not got:
                got.update(probe[0].stop())
            return func(*args, **kwargs)
        return wrapped

    def keep(self, *args, **kwargs):
        text_data(self, *args, **kwargs)
        corpus.append(self.tokens.untyped_storage().nbytes())

    ldt.initialize_vtp = initialize_then_start
    loop.gather_timings = stop_first(loop.gather_timings)
    loop.write_outputs = stop_first(loop.write_outputs)
    TextData.__init__ = keep
    train_worker(rank, world, cfg, run_dir)
    if not got:
        got.update(probe[0].stop())
    return dict(got, corpus=sum(corpus), pinned=getattr(probe[0], "pinned", lambda: None)())


def resident_peaks(cfg: dict) -> list[dict]:
    """:func:`resident_worker` on every rank, in a fresh process started with
    :data:`bench.resident.MALLOC_ENV` (glibc reads it once, at start, and the ranks are forked
    from that process's forkserver); per rank, ``peak`` bytes with the corpus taken out on a
    resident measure (and ``reserved`` on a cuda stage)."""
    import json
    import subprocess

    from bench.resident import MALLOC_ENV

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.bench_memory", "resident", f.name],
                              cwd=root, env=dict(os.environ, **MALLOC_ENV), capture_output=True,
                              text=True, timeout=900)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"the resident world failed:\n{proc.stderr[-3000:]}")
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in ranks:
        if not r["pinned"] and r["pinned"] is not None:
            raise RuntimeError("glibc's mmap threshold was not pinned in the resident world")
        if "reserved" not in r:  # host memory: the corpus is in it
            r["peak"] -= r["corpus"]
    return ranks


def _resident_main(path: str) -> None:
    import json

    from ldt.launch.local import run_local_world
    from ldt.topology.validate import validate

    cfg = json.load(open(path))
    topo = validate(cfg["cluster"], cfg["model"], check_devices=False)
    out = run_local_world(topo.world_size, resident_worker, (cfg, cfg["run_dir"]),
                          timeout_s=600)
    print(json.dumps(out))


def timed_worker(rank: int, world: int, cfg: dict, run_dir: str):
    from ldt.training.loop import train_worker

    return train_worker(rank, world, cfg, run_dir)


def real_allocations(cases=REAL_CASES, sizes=("shipped", "scaled")) -> list[dict]:
    from ldt.launch.local import run_local_world
    from ldt.memory import estimate
    from ldt.topology.validate import validate

    rows = []
    for size in sizes:
        for cluster, rc, sp, *model in cases:
            name = (model or ["gpt_tiny"])[0]
            extra = [f"model={name}"] + (SCALED[name] if size == "scaled" else [])
            cfg = config(cluster, rc, sp, *extra)
            topo = validate(cfg["cluster"], cfg["model"], check_devices=False)
            stages = estimate(cfg)
            cfg["run_dir"] = tempfile.mkdtemp(prefix="ldt-bench-memory-")
            tracked = run_local_world(topo.world_size, measured_worker,
                                      (cfg, cfg["run_dir"]), timeout_s=600)
            cfg["run_dir"] = tempfile.mkdtemp(prefix="ldt-bench-memory-")
            resident = resident_peaks(cfg)
            for rank, (tracker, res) in enumerate(zip(tracked, resident)):
                st = stages[topo.rank_info(rank).stage]
                row = {"size": size, "cluster": cluster, "model": name, "recompute": rc,
                       "sp": sp, "rank": rank, "stage": st.name, "device": st.device,
                       "estimate_mib": st.peak / MIB, "tracker_mib": tracker / MIB,
                       "resident_mib": res["peak"] / MIB, "vs_tracker": st.peak / tracker,
                       "vs_resident": st.peak / res["peak"], "samples": res.get("samples")}
                if "reserved" in res:
                    row.update(reserved_mib=res["reserved"] / MIB,
                               vs_reserved=st.peak / res["reserved"])
                rows.append(row)
                print(f"{size:7s} {cluster:8s} {name:14s} recompute={str(rc):5s} "
                      f"sp={str(sp):5s} rank {rank} ({st.name:6s}): estimate "
                      f"{st.peak / MIB:7.3f} MiB, tracker {tracker / MIB:7.3f}, resident "
                      f"{res['peak'] / MIB:7.3f}; estimate/tracker {row['vs_tracker']:.3f}, "
                      f"estimate/resident {row['vs_resident']:.3f}", flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per size, the range of estimate / each measure over every rank, and the ranks where the
    estimate does not bound the resident peak from above within 10% (1.0 <= ratio <= 1.1)."""
    out = {}
    for size in sorted({r["size"] for r in rows}):
        mine = [r for r in rows if r["size"] == size]
        out[size] = {"ranks": len(mine)} | {
            key: {"min": round(min(r[key] for r in mine), 4),
                  "max": round(max(r[key] for r in mine), 4)}
            for key in ("vs_tracker", "vs_resident")} | {
            "resident_minus_estimate_mib": {
                "min": round(min(r["resident_mib"] - r["estimate_mib"] for r in mine), 3),
                "max": round(max(r["resident_mib"] - r["estimate_mib"] for r in mine), 3)},
            "not_bounded": sum(not 1.0 <= r["vs_resident"] <= 1.1 for r in mine)}
    return out


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
    from ldt.launch.local import run_local_world
    from ldt.memory import estimate
    from ldt.plan import load_inventory, simulate_plan
    from ldt.plan.clusters import cluster_to_plan
    from ldt.plan.cost import CostModel
    from ldt.plan.memory_cost import Recompute
    from ldt.topology.validate import validate
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


def main(parts=("real", "planner", "recompute"), sizes=("shipped", "scaled"),
         clusters=None) -> dict:
    from bench.common import machine_load

    load = machine_load()
    t0 = time.perf_counter()
    out: dict = {"bench": "memory"}
    if "real" in parts:
        cases = [c for c in REAL_CASES if clusters is None or c[0] in clusters]
        real = real_allocations(cases, sizes)
        out.update(real=real, real_summary=summary(real))
        _print_summary(out["real_summary"])
    if "planner" in parts:
        planned = planner_vs_estimate()
        out.update(planner=planned, planner_vs_estimate=_range([r["ratio"] for r in planned]))
    if "recompute" in parts:
        out["recompute"] = recompute_cost()
    out["seconds"] = round(time.perf_counter() - t0)
    print(f"({out['seconds']} s)")
    return emit(out, load)


def _range(values) -> dict:
    return {"min": round(min(values), 4), "max": round(max(values), 4), "n": len(values)}


def _print_summary(got: dict) -> None:
    for size, g in got.items():
        print(f"{size}: estimate / tracker {g['vs_tracker']['min']:.3f} to "
              f"{g['vs_tracker']['max']:.3f}, estimate / resident {g['vs_resident']['min']:.3f}"
              f" to {g['vs_resident']['max']:.3f} over {g['ranks']} ranks (resident - estimate "
              f"{g['resident_minus_estimate_mib']['min']:.2f} to "
              f"{g['resident_minus_estimate_mib']['max']:.2f} MiB)")


def merge(paths: list[str]) -> dict:
    """One JSON line from the JSON lines of runs of parts of this bench (the real part in
    pieces, each under the machine's lock for a few minutes): rows concatenated, the summary
    recomputed, each piece's load kept."""
    import json

    out: dict = {"bench": "memory", "pieces": []}
    for path in paths:
        for line in open(path):
            if not line.startswith('{"bench": "memory"'):
                continue
            piece = json.loads(line)
            out["real"] = out.get("real", []) + piece.get("real", [])
            for key in ("planner", "recompute"):
                if key in piece:
                    out[key] = piece[key]
            out["pieces"].append({k: piece.get(k) for k in ("load", "seconds")}
                                 | {"parts": [k for k in ("real", "planner", "recompute")
                                              if k in piece]})
    if out.get("real"):
        out["real_summary"] = summary(out["real"])
        _print_summary(out["real_summary"])
    if out.get("planner"):
        out["planner_vs_estimate"] = _range([r["ratio"] for r in out["planner"]])
    return emit(out)


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(prog="bench_memory")
    cli.add_argument("parts", nargs="*", default=["real", "planner", "recompute"],
                     help="real, planner, recompute; or layers; or resident FILE; or merge FILE...")
    cli.add_argument("--size", action="append", choices=["shipped", "scaled"])
    cli.add_argument("--cluster", action="append")
    args = cli.parse_args()
    if args.parts[:1] == ["layers"]:
        layers()
    elif args.parts[:1] == ["resident"]:
        _resident_main(args.parts[1])
    elif args.parts[:1] == ["merge"]:
        merge(args.parts[1:])
    else:
        main(tuple(args.parts), tuple(args.size or ("shipped", "scaled")), args.cluster)
