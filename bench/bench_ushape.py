"""U-shape vs plain 1F1B: same model, same world, same micro-batches, measured and predicted.

Three stages of TP 1 (3 gloo processes), 6 decoder layers, 2 per stage either way:

* ``ushape``: layout ``Et|tt|tt|tL`` -- stage 0 runs the embedding + 1 layer (FS/BE) and the
  last layer + head + loss (FE/BS), stages 1-2 the body; activations wrap back to stage 0;
* ``1f1b``:   layout ``Ett|tt|ttL`` -- the embedding on stage 0, head + loss on stage 2.

Both run on ldt's runtime (``train.runtime=ldt`` for the plain pipeline; the U-shape always
does), so the comparison is schedule against schedule with the same executor and communicator.
One world, one set of groups: a topology's boundary groups include the wraparound P-1 -> 0
boundary whether or not it is a U-shape, so the plain state is the U-shape state with the plain
topology swapped in (no group is created while timing). Repetitions alternate ABBA.

Every rank runs on a host of its own CPU quota (``bench.common.run_on_hosts``): the two
schedules idle different stages at different times, and on shared cores an idle stage lent
its core to the busy ones (issue #45).

Prediction: the simulator replays the action lists both runs executed with the per-(stage, op)
mean times recorded during these very runs (compute only, and again with the communication
actions' own times and the stage start offsets, see ldt/plan/calibrate.py), and the ratio of the
two simulated iteration times is compared with the measured median ratio.
"""

from __future__ import annotations

import dataclasses

from bench.common import (HOST_CPUS, build_chunks, emit, machine_load, make_batches, median,
                          run_on_hosts, spread, timed_step, zero_grads)

MODEL = dict(name="bench", num_layers=6, hidden_size=128, num_attention_heads=4,
             ffn_hidden_size=512, vocab_size=256, seq_length=128)
MBS, M, REPS = 2, 6, 24
LAYOUTS = {"ushape": "Et|tt|tt|tL", "1f1b": "Ett|tt|ttL"}

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("step U-shape / plain 1F1B (TP [1,1,1], m=6, ldt's runtime), one rank per host of "
     "{cpus_per_rank} core; median of per-repetition ratios (quartiles)",
     "**{median_ratio:.3f}** ({ratio_spread[q1]:.3f}-{ratio_spread[q3]:.3f}); "
     "{ushape_ms:.0f} / {1f1b_ms:.0f} ms", "-"),
    ("the simulator's ratio from the runs' own action times (compute only)",
     "**{predicted_ratio_with_comm:.3f}** ({predicted_ratio:.3f})", "-"),
]


def _worker(rank, world, model_dict, m, reps):
    import time

    from megatron.core import tensor_parallel

    import ldt
    from ldt import patches
    from ldt.config import ClusterConfig, ModelConfig, StageConfig
    from ldt.boundary.communicator import VtpCommunicator
    from ldt.groups.parallel_state import install_megatron
    from ldt.pipeline.forward_backward import run_step
    from ldt.training.stage import make_forward_step
    from ldt.topology.validate import validate

    model = ModelConfig(**model_dict)
    stages = [StageConfig(f"s{i}", "cpu", 1) for i in range(3)]
    topos = {k: validate(ClusterConfig(stages=stages, u_shape=k == "ushape", layout=v), model,
                         world_size=world) for k, v in LAYOUTS.items()}
    patches.apply(["cpu_shims"])
    u_state = ldt.initialize_vtp(topos["ushape"], timeout_s=120)
    states = {"ushape": u_state,
              "1f1b": dataclasses.replace(u_state, topology=topos["1f1b"])}
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    models = {k: build_chunks(model, topos[k].split, u_state.stage, 1, 0,
                              pg_collection=u_state.pg_collection()) for k in LAYOUTS}
    batches = make_batches(model, MBS, m)
    fwd = make_forward_step(model.seq_length)

    def run(kind):
        state, chunks = states[kind], models[kind]
        install_megatron(state)  # megatron's view of this stage (no new groups)
        zero_grads(chunks)
        reads = state.stage in state.topology.data_stages()
        out = {}

        def step():
            out["res"] = run_step(
                forward_step_func=fwd, data_iterator=iter(batches) if reads else None,
                model=chunks, num_microbatches=m, seq_length=model.seq_length,
                micro_batch_size=MBS, comm=VtpCommunicator(chunks[0].config, state),
                state=state, config=chunks[0].config, record_timings=True)

        # out["t0"]: this rank's step start, after the barrier (per-action rows are relative)
        elapsed = timed_step(lambda: (out.__setitem__("t0", time.perf_counter()), step()))
        rows = [(str(a), s - out["t0"], e - out["t0"]) for a, s, e in out["res"].timings]
        return elapsed, (out["t0"], rows)  # t0: perf_counter, one clock for this host's ranks

    kinds = list(LAYOUTS)
    for k in kinds:
        run(k)  # warm-up
    reps_out = []
    for i in range(reps):
        order = kinds if i % 2 == 0 else kinds[::-1]
        reps_out.append({k: run(k) for k in order})
    patches.revert()
    ldt.destroy_vtp()
    return reps_out


def _predict(per_rank: list, m: int) -> dict:
    """Simulated iteration times from the per-action times every stage recorded."""
    from ldt.plan import calibrate
    from ldt.schedule import parse_action

    out = {}
    for kind in LAYOUTS:
        rows = [calibrate.ActionTime(i, parse_action(a), s, e, "local", rep[kind][1][0])
                for reps in per_rank for i, rep in enumerate(reps) for a, s, e in rep[kind][1][1]]
        cal = calibrate.calibrate(rows)
        out[kind] = {
            "raw": cal.predict(compute_only=True).iteration_time,
            "full": cal.predict().iteration_time,
            "table_ms": {f"{s}{op.value}": round(d * 1e3, 2)
                         for (s, op), d in sorted(cal.compute.items())},
        }
    return out


def main() -> dict:
    from ldt.testing.hosts import unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return {"bench": "ushape_vs_1f1b", "skipped": reason}
    load = machine_load()
    per_rank = run_on_hosts(_worker, (MODEL, M, REPS), 3)
    reps = per_rank[0]
    times = [{k: rep[k][0] for k in LAYOUTS} for rep in reps]
    ratios = [t["ushape"] / t["1f1b"] for t in times]
    pred = _predict(per_rank, M)
    predicted = pred["ushape"]["raw"] / pred["1f1b"]["raw"]
    predicted_full = pred["ushape"]["full"] / pred["1f1b"]["full"]
    print(f"U-shape (Et|tt|tt|tL) vs plain 1F1B (Ett|tt|ttL), TP [1,1,1], {M} micro-batches of "
          f"{MBS}x{MODEL['seq_length']}, hidden {MODEL['hidden_size']}; ldt runtime for both; "
          f"one rank per host of {HOST_CPUS} core")
    print(f"{'rep':>4} {'ushape ms':>10} {'1f1b ms':>9} {'ratio':>7}")
    for i, t in enumerate(times):
        print(f"{i:>4} {t['ushape'] * 1e3:10.2f} {t['1f1b'] * 1e3:9.2f} {ratios[i]:7.3f}")
    for kind in LAYOUTS:
        print(f"  {kind}: measured median {median(t[kind] for t in times) * 1e3:.1f} ms; simulated "
              f"{pred[kind]['raw'] * 1e3:.1f} ms (compute only), {pred[kind]['full'] * 1e3:.1f} "
              f"ms (+ communication and start offsets); per-action means ms {pred[kind]['table_ms']}")
    print(f"  median ratio ushape/1f1b {median(ratios):.3f}; predicted {predicted:.3f} "
          f"(compute only), {predicted_full:.3f} (+ communication)")
    return emit({"bench": "ushape_vs_1f1b", "median_ratio": round(median(ratios), 3),
                 "cpus_per_rank": HOST_CPUS,
                 "ratio_spread": spread(ratios),
                 "predicted_ratio": round(predicted, 3),
                 "predicted_ratio_with_comm": round(predicted_full, 3),
                 "ushape_ms": round(median(t["ushape"] for t in times) * 1e3, 1),
                 "1f1b_ms": round(median(t["1f1b"] for t in times) * 1e3, 1)}, load_before=load)


if __name__ == "__main__":
    main()
