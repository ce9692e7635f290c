"""Sequence parallelism on a TP 2 stage: per-rank activation memory and step time, off vs on.

One local gloo world, a VTP pipeline TP 2 -> TP 1 (megatron's 1F1B through ldt's boundaries:
with sequence parallelism the TP 2 stage's leader gathers its sequence slices before each
send and scatters each received gradient). The same weights and batches run twice per
repetition, sequence parallelism off and on, alternating which goes first (ABBA).

Activation memory is what autograd keeps for the backward pass: every tensor saved during
the forward passes is counted (``torch.autograd.graph.saved_tensors_hooks``, one count per
storage) from the moment it is saved until autograd frees it, and the peak of that live sum
over a whole 1F1B step is reported per rank (all micro-batches in flight included). It is
split into tensors of the ``[s, b, h]`` family (the activations outside attention and the
MLP, which sequence parallelism divides by TP) and the rest. Step time: forward + backward
of all micro-batches between two world barriers (the slowest rank's). Prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace

from bench.common import (build_chunks, emit, machine_load, make_batches, median, spread,
                          timed_step, zero_grads)

MODEL = dict(name="bench", num_layers=4, hidden_size=128, num_attention_heads=4,
             ffn_hidden_size=512, vocab_size=256, seq_length=256)
MBS, M, REPS = 2, 4, 10
TPS = (2, 1)
MIB = 2**20

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("TP 2 stage, peak saved activations per rank, sequence parallelism on / off (`[s,b,h]` "
     "tensors); the planner's prediction",
     "**{tp2_peak_activation_ratio:.3f}** ({tp2_sbh_activation_ratio:.3f}); planner "
     "{planner_tp2_activation_mib[on]:.2f} / {planner_tp2_activation_mib[off]:.2f} MiB",
     "~0.5 outside attention"),
    ("step time on / off, TP 2 -> TP 1 (median, quartiles; one world on shared cores)",
     "{step_time_ratio:.3f} ({step_time_ratio_spread[q1]:.3f}-"
     "{step_time_ratio_spread[q3]:.3f}); losses differ by {loss_max_abs_diff:.1e}", "-"),
]
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("docs/sequence_parallel.md", "| TP 2 stage, peak saved activations per rank (rank 0) | "
     "{per_rank[0][peak_mib_off]:.2f} MiB | {per_rank[0][peak_mib_on]:.2f} MiB | "
     "{tp2_peak_activation_ratio:.3f} |"),
    ("docs/sequence_parallel.md", "| of which `[s, b, h]` tensors (outside attention / MLP) | "
     "{per_rank[0][sbh_mib_off]:.2f} MiB | {per_rank[0][sbh_mib_on]:.2f} MiB | "
     "{tp2_sbh_activation_ratio:.3f} |"),
    ("docs/sequence_parallel.md", "| TP 1 stage | {per_rank[2][peak_mib_off]:.2f} MiB | "
     "{per_rank[2][peak_mib_on]:.2f} MiB |"),
    ("docs/sequence_parallel.md", "| planner's prediction for the TP 2 stage (no flash "
     "attention) | {planner_tp2_activation_mib[off]:.2f} MiB | "
     "{planner_tp2_activation_mib[on]:.2f} MiB | {planner_tp2_activation_ratio:.3f} |"),
    ("docs/sequence_parallel.md", "| step time (median of {step_time_ratio_spread[n]}, on / off;"
     " quartiles {step_time_ratio_spread[q1]:.2f}-{step_time_ratio_spread[q3]:.2f}) | | | "
     "{step_time_ratio:.2f} |"),
]


class SavedTensorMeter:
    """Live bytes of the tensors autograd saved for backward (parameters excluded), and the
    peaks of the total and of the ``[., ., hidden]`` family."""

    def __init__(self, hidden: int, params):
        self.hidden = hidden
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}

    def _pack(self, t):
        import torch

        if not isinstance(t, torch.Tensor):
            return t
        key = t.untyped_storage().data_ptr()
        if key and key not in self.saved and key not in self.param_storages:
            nbytes = t.untyped_storage().nbytes()
            sbh = t.dim() == 3 and t.shape[-1] == self.hidden
            self.saved[key] = (nbytes, sbh)
            self.live += nbytes
            self.live_sbh += nbytes if sbh else 0
            self.peak = max(self.peak, self.live)
            self.peak_sbh = max(self.peak_sbh, self.live_sbh)
            weakref.finalize(t, self._free, key)
        return t

    def _free(self, key) -> None:
        nbytes, sbh = self.saved.pop(key, (0, False))
        self.live -= nbytes
        self.live_sbh -= nbytes if sbh else 0

    def __enter__(self):
        import torch

        self.saved, self.live, self.live_sbh, self.peak, self.peak_sbh = {}, 0, 0, 0, 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _worker(rank, world, model_dict, reps):
    import torch
    from megatron.core import tensor_parallel

    import ldt
    from ldt import patches
    from ldt.config import ClusterConfig, ModelConfig, StageConfig
    from ldt.testing.grads import allreduce_sequence_parallel_grads
    from ldt.training.stage import make_forward_step
    from ldt.topology.validate import validate

    torch.manual_seed(0)
    plain = ModelConfig(**model_dict)
    cluster = ClusterConfig(stages=[StageConfig(f"s{i}", "cpu", t) for i, t in enumerate(TPS)])
    topo = validate(cluster, plain, world_size=world)
    state = ldt.initialize_vtp(topo, timeout_s=120)
    from ldt.pipeline.forward_backward import MegatronHooks
    patches.apply(["cpu_shims", "sequence_parallel_norms", "schedules"],
                  ctx=MegatronHooks())
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp, tp_rank = TPS[state.stage], state.info.tp_rank
    models = {}
    for name, model in (("off", plain), ("on", dataclasses.replace(plain, sequence_parallel=True))):
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        models[name] = build_chunks(model, topo.split, state.stage, tp, tp_rank,
                                    pg_collection=state.pg_collection())
    batches = make_batches(plain, MBS, M)
    reads = state.stage in topo.data_stages()
    fwd = make_forward_step(plain.seq_length)
    meter = SavedTensorMeter(plain.hidden_size,
                             [p for chunks in models.values() for g in chunks
                              for p in g.parameters()])
    losses, memory = {}, {}

    def run(name):
        chunks = models[name]
        zero_grads(chunks)
        out = {}

        def step():
            with meter:
                out["l"] = get_forward_backward_func()(
                    forward_step_func=fwd, data_iterator=iter(batches) if reads else None,
                    model=chunks[0], num_microbatches=M, seq_length=plain.seq_length,
                    micro_batch_size=MBS)
            allreduce_sequence_parallel_grads(chunks, state.tp_group)

        t = timed_step(step)
        losses[name] = [float(x["lm loss"]) for x in out["l"]]
        memory[name] = (meter.peak, meter.peak_sbh)
        return t

    for name in ("off", "on"):  # warm-up
        run(name)
    rows = []
    for i in range(reps):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        rows.append({name: run(name) for name in order})
    loss_diff = max((abs(a - b) for a, b in zip(losses["off"], losses["on"])), default=0.0)
    patches.revert()
    ldt.destroy_vtp()
    return {"stage": state.stage, "tp": tp, "rows": rows, "memory": memory,
            "loss_diff": loss_diff, "has_loss": bool(losses["off"])}


def main() -> dict:
    from ldt.launch.local import run_local_world

    load = machine_load()
    results = run_local_world(sum(TPS), _worker, (MODEL, REPS), timeout_s=300)
    rows = results[0]["rows"]
    step_ratio = median(r["on"] / r["off"] for r in rows)
    print(f"sequence parallelism, pipeline TP {'/'.join(map(str, TPS))}, "
          f"{MODEL['num_layers']} layers h={MODEL['hidden_size']} s={MODEL['seq_length']} "
          f"b={MBS}, {M} micro-batches (1F1B)")
    print("rank stage tp   peak saved MiB off -> on (ratio)   [s,b,h] MiB off -> on (ratio)")
    per_rank = []
    for rank, r in enumerate(results):
        (off, off_sbh), (on, on_sbh) = r["memory"]["off"], r["memory"]["on"]
        per_rank.append({"rank": rank, "stage": r["stage"], "tp": r["tp"],
                         "peak_mib_off": off / MIB, "peak_mib_on": on / MIB,
                         "sbh_mib_off": off_sbh / MIB, "sbh_mib_on": on_sbh / MIB})
        print(f"{rank:>4} {r['stage']:>5} {r['tp']:>2}   {off / MIB:7.2f} -> {on / MIB:7.2f} "
              f"({on / off:.3f})          {off_sbh / MIB:6.2f} -> {on_sbh / MIB:6.2f} "
              f"({on_sbh / max(off_sbh, 1):.3f})")
    print(f"step time on/off (median of {len(rows)}): {step_ratio:.3f}")
    tp2 = [p for p in per_rank if p["tp"] == 2]
    planned = _planner_tp2_activations()
    print(f"planner, stage 0 (TP 2) activations MiB off -> on: {planned['off']:.2f} -> "
          f"{planned['on']:.2f} ({planned['on'] / planned['off']:.3f})")
    return emit({
        "bench": "seqpar",
        "tp2_peak_activation_ratio": max(p["peak_mib_on"] / p["peak_mib_off"] for p in tp2),
        "tp2_sbh_activation_ratio": max(p["sbh_mib_on"] / p["sbh_mib_off"] for p in tp2),
        "step_time_ratio": step_ratio,
        "step_time_ratio_spread": spread(r["on"] / r["off"] for r in rows),
        "loss_max_abs_diff": max(r["loss_diff"] for r in results if r["has_loss"]),
        "planner_tp2_activation_mib": planned,
        "planner_tp2_activation_ratio": planned["on"] / planned["off"],
        "per_rank": per_rank,
    }, load_before=load)


def _planner_tp2_activations() -> dict:
    """What ldt's cost model predicts for stage 0 (the local spec materialises attention
    scores on CPU: no flash attention; 1F1B keeps 2 micro-batches in flight there)."""
    from ldt.config import ModelConfig
    from ldt.plan.cost import ChunkLoad, CostModel

    plain = ModelConfig(**MODEL)
    chunk = [ChunkLoad(MODEL["num_layers"] // 2, embedding=True, inflight=len(TPS))]
    return {name: CostModel(model, None, MBS, flash_attention=False)
            .stage_memory("cpu", TPS[0], chunk).activations / MIB
            for name, model in (("off", plain),
                                ("on", dataclasses.replace(plain, sequence_parallel=True)))}


if __name__ == "__main__":
    main()
