"""VTP overhead: one training step through ldt's VTP path vs megatron-core's own uniform path.

Same model, same layout, same per-stage TP sizes (uniform, so megatron-core can run it as it
is), same weights and batches, in ONE local gloo world:

* ``megatron``: ``parallel_state.initialize_model_parallel(tp, pp)``, only the ``cpu_shims``
  patch (CPU token counter, RNG tracker, receive buffers), chunks built against megatron's
  global groups, ``get_forward_backward_func()`` unpatched -> megatron's 1F1B with its default
  ``P2PCommunicator`` (every TP rank sends to its peer rank of the next stage).
* ``ldt``: ``ldt.initialize_vtp`` + the ``schedules`` patch, chunks built on the stage's
  ``pg_collection``, ``get_forward_backward_func()`` -> megatron's 1F1B with a fresh
  ``VtpCommunicator`` per step (leader send/recv + TP broadcast), exactly what ``ldt-train``
  does for a plain pipeline.
* ``ldt runtime`` (extra column): ldt's own runtime walking the simulator's 1F1B action list
  (``train.runtime=ldt``), same VTP state and communicator.

Both states live in the same world: megatron's groups are created first and its
``parallel_state`` globals are snapshotted; switching paths restores one snapshot or the other
(no group is created or destroyed while timing). Repetitions alternate which path goes first
(ABBA), so drift from other load on the machine hits both. Timed: forward + backward of all
micro-batches between two world barriers (the optimizer step is identical on both paths and
left out). Every rank runs on a host of its own CPU quota (``bench.common.run_on_hosts``,
``HOST_CPUS`` cores each): on shared cores a rank idle in one path's bubbles or transfers
lends its core to the others (issue #45). Prints a per-repetition table and one JSON line.
"""

from __future__ import annotations

from types import SimpleNamespace

from bench.common import (HOST_CPUS, build_chunks, emit, machine_load, make_batches, median,
                          run_on_hosts, spread, timed_step, zero_grads)

MODEL = dict(name="bench", num_layers=8, hidden_size=128, num_attention_heads=4,
             ffn_hidden_size=512, vocab_size=256, seq_length=128)
MBS, M = 2, 4
REPS = 20
TP_CASES = [(1, 1), (2, 2)]  # world sizes 2 and 4

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("step ldt / megatron (megatron's 1F1B over ldt's boundaries), TP [1,1] / [2,2], one rank "
     "per host of {cpus_per_rank} core; median of per-repetition ratios (quartiles)",
     "**{median_ratio_by_tp[1x1]:.3f}** ({ratio_spread_by_tp[1x1][q1]:.3f}-"
     "{ratio_spread_by_tp[1x1][q3]:.3f}) / **{median_ratio_by_tp[2x2]:.3f}** "
     "({ratio_spread_by_tp[2x2][q1]:.3f}-{ratio_spread_by_tp[2x2][q3]:.3f})", "<= 1.05"),
    ("ldt's runtime (`train.runtime=ldt`) / megatron, TP [1,1] / [2,2]",
     "{runtime_median_ratio_by_tp[1x1]:.3f} / {runtime_median_ratio_by_tp[2x2]:.3f}", "-"),
    ("megatron's step (forward + backward, 4 micro-batches), TP [1,1] / [2,2]",
     "{megatron_ms[1x1]:.0f} / {megatron_ms[2x2]:.0f} ms", "-"),
    ("largest loss difference ldt / megatron (same weights, same batches)",
     "{max_loss_diff:.1e}", "-"),
]


def _snapshot(module) -> dict:
    """All of a module's private globals (megatron's parallel_state keeps its groups there)."""
    return {k: v for k, v in vars(module).items() if k.startswith("_") and k[1:2].isupper()}


def _restore(module, snap: dict) -> None:
    for k, v in snap.items():
        setattr(module, k, v)


def _worker(rank, world, tps, model_dict, reps):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    import ldt
    from ldt import patches
    from ldt.config import ClusterConfig, ModelConfig, StageConfig
    from ldt.pipeline.forward_backward import run_step
    from ldt.boundary.communicator import VtpCommunicator
    from ldt.training.stage import make_forward_step
    from ldt.topology.validate import validate

    torch.manual_seed(0)
    model = ModelConfig(**model_dict)
    pp, tp = len(tps), tps[0]
    cluster = ClusterConfig(stages=[StageConfig(f"s{i}", "cpu", t) for i, t in enumerate(tps)])
    topo = validate(cluster, model, world_size=world)
    patches.apply(["cpu_shims"])

    # megatron-core's own uniform state and chunks
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    stage, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    m_models = build_chunks(model, topo.split, stage, tp, tp_rank)
    m_snap = _snapshot(ps)

    # ldt's VTP state (same ranks per stage: megatron's default order puts TP innermost)
    state = ldt.initialize_vtp(topo, timeout_s=120)
    assert (state.stage, state.info.tp_rank) == (stage, tp_rank), "rank maps differ"
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    l_models = build_chunks(model, topo.split, stage, tp, tp_rank,
                            pg_collection=state.pg_collection())
    l_snap = _snapshot(ps)

    batches = make_batches(model, MBS, M)
    fwd = make_forward_step(model.seq_length)
    reads_data = stage in topo.data_stages()
    common = dict(forward_step_func=fwd, num_microbatches=M, seq_length=model.seq_length,
                  micro_batch_size=MBS)
    losses = {}

    def run(path):
        """Switch megatron's globals to the path's state, then one timed forward-backward."""
        if path == "megatron":
            _restore(ps, m_snap)
            from megatron.core.pipeline_parallel import get_forward_backward_func
            models, step = m_models, lambda: get_forward_backward_func()(
                data_iterator=iter(batches) if reads_data else None, model=models[0], **common)
        else:
            _restore(ps, l_snap)
            from ldt.pipeline.forward_backward import MegatronHooks
            patches.apply(["schedules"], ctx=MegatronHooks())
            from megatron.core.pipeline_parallel import get_forward_backward_func
            models = l_models
            if path == "ldt":
                step = lambda: get_forward_backward_func()(
                    data_iterator=iter(batches) if reads_data else None, model=models[0],
                    **common)
            else:  # ldt's runtime
                step = lambda: run_step(
                    data_iterator=iter(batches) if reads_data else None, model=models,
                    comm=VtpCommunicator(models[0].config, state), state=state,
                    config=models[0].config, **common).losses
        zero_grads(models)
        out = {}
        t = timed_step(lambda: out.setdefault("l", step()))
        if path != "megatron":
            patches.revert(["schedules"])
        losses[path] = [float(x["lm loss"]) for x in out["l"]]
        return t

    paths = ["megatron", "ldt", "ldt_runtime"]
    for p in paths:  # warm-up (allocator, autograd graph caches, gloo connections)
        run(p)
    rows = []
    for i in range(reps):
        order = paths if i % 2 == 0 else paths[::-1]
        times = {p: run(p) for p in order}
        rows.append(times)
    loss_diff = max((abs(a - b) for a, b in zip(losses["megatron"], losses["ldt"])), default=0.0)
    patches.revert()
    ldt.destroy_vtp()
    return {"rows": rows, "loss_diff": loss_diff, "has_loss": bool(losses["megatron"])}


def _case(tps: tuple) -> dict:
    results = run_on_hosts(_worker, (list(tps), MODEL, REPS), sum(tps))
    rows = results[0]["rows"]
    loss_diff = max(r["loss_diff"] for r in results if r["has_loss"])
    ratios = [r["ldt"] / r["megatron"] for r in rows]
    rt_ratios = [r["ldt_runtime"] / r["megatron"] for r in rows]
    return {"tp": list(tps), "rows": rows, "ratios": ratios, "median_ratio": median(ratios),
            "ratio_of_medians": median(r["ldt"] for r in rows) / median(r["megatron"] for r in rows),
            "runtime_median_ratio": median(rt_ratios),
            "megatron_ms": median(r["megatron"] for r in rows) * 1e3,
            "ldt_ms": median(r["ldt"] for r in rows) * 1e3,
            "runtime_ms": median(r["ldt_runtime"] for r in rows) * 1e3, "loss_diff": loss_diff}


def _print(case: dict) -> None:
    print(f"TP {case['tp']} ({len(case['tp'])} stages, world {sum(case['tp'])}): forward-backward "
          f"of {M} micro-batches, per repetition")
    print(f"{'rep':>4} {'megatron ms':>12} {'ldt ms':>9} {'ldt/meg':>8} {'ldt runtime ms':>15} "
          f"{'runtime/meg':>12}")
    for i, r in enumerate(case["rows"]):
        print(f"{i:>4} {r['megatron'] * 1e3:12.2f} {r['ldt'] * 1e3:9.2f} {r['ldt'] / r['megatron']:8.3f} "
              f"{r['ldt_runtime'] * 1e3:15.2f} {r['ldt_runtime'] / r['megatron']:12.3f}")
    print(f"  median: megatron {case['megatron_ms']:.2f} ms, ldt {case['ldt_ms']:.2f} ms, "
          f"ldt runtime {case['runtime_ms']:.2f} ms; median ratio ldt/megatron "
          f"{case['median_ratio']:.3f} (ratio of medians {case['ratio_of_medians']:.3f}), "
          f"ldt runtime/megatron {case['runtime_median_ratio']:.3f}; "
          f"max |loss diff| {case['loss_diff']:.2e}")


def main() -> dict:
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "vtp_overhead", "skipped": reason}
    load = machine_load()
    cases = [_case(tps) for tps in TP_CASES]
    print(f"model: {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, seq "
          f"{MODEL['seq_length']}, micro-batch {MBS}, {M} micro-batches; {REPS} repetitions; "
          f"one rank per host of {HOST_CPUS} core")
    for c in cases:
        _print(c)
    worst = max(cases, key=lambda c: c["median_ratio"])
    return emit({"bench": "vtp_overhead", "median_ratio": round(worst["median_ratio"], 3),
                 "cpus_per_rank": HOST_CPUS,
                 "median_ratio_by_tp": {"x".join(map(str, c["tp"])): round(c["median_ratio"], 3)
                                        for c in cases},
                 "runtime_median_ratio_by_tp": {"x".join(map(str, c["tp"])):
                                                round(c["runtime_median_ratio"], 3) for c in cases},
                 "ratio_spread_by_tp": {"x".join(map(str, c["tp"])): spread(c["ratios"])
                                        for c in cases},
                 "megatron_ms": {"x".join(map(str, c["tp"])): round(c["megatron_ms"], 2)
                                 for c in cases},
                 "max_loss_diff": max(c["loss_diff"] for c in cases)}, load_before=load)


if __name__ == "__main__":
    main()
