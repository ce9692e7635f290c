"""megatron-core's optimizer stack under ldt: optimizer-state memory and overlapped grad reduce.

One local gloo world of one stage at dp 2 (ldt's VTP state, ldt's stage building and
:func:`ldt.training.optim.build_stage_optimizer`, megatron's 1F1B schedule), two questions:

* **state bytes per rank**: bf16 weights with fp32 main params and Adam; the bytes of the
  optimizer's own tensors on one rank (fp32 main params, exp_avg, exp_avg_sq) with
  ``train.distributed_optimizer=true`` over ``false``. Sharded over 2 DP ranks it must halve
  (0.5, plus the rounding of megatron's bucket padding).
* **overlapped grad reduce**: fp32 step time (forward-backward, reduce, optimizer step) with
  ``train.overlap_grad_reduce=true`` over ``false`` (small buckets, so reduces can start
  during the backward pass). On this 2-core CPU the reduce and the compute share the cores,
  so expect little gain; the ratio is what to compare on GPUs.

Prints one JSON line: ``state_bytes_ratio`` (distributed / replicated) and
``overlap_step_time_ratio`` (overlapped / not).
"""

from __future__ import annotations

import time

from bench.common import emit, machine_load, make_batches, median, spread

MODEL = dict(name="bench", num_layers=4, hidden_size=128, num_attention_heads=4,
             ffn_hidden_size=512, vocab_size=256, seq_length=64)
MBS, M, DP = 2, 4, 2
STEPS = 8

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("optimizer-state bytes per rank at dp {dp}, distributed / replicated optimizer (bf16 + "
     "fp32 main params, Adam)",
     "**{state_bytes_ratio:.3f}** ({state_bytes_distributed} / {state_bytes_replicated} "
     "bytes)", "0.5"),
    ("step time, overlapped / plain grad reduce (fp32, dp {dp}; runs in ABBA order, medians, "
     "quartiles)",
     "{overlap_step_time_ratio:.3f} ({step_time_s_overlap:.3f} s, "
     "{step_time_s_overlap_spread[q1]:.3f}-{step_time_s_overlap_spread[q3]:.3f} / "
     "{step_time_s_no_overlap:.3f} s, {step_time_s_no_overlap_spread[q1]:.3f}-"
     "{step_time_s_no_overlap_spread[q3]:.3f})", "-"),
]
# figures documents quote from the latest run (bench.summary, tests/test_bench_summary.py)
QUOTES = [
    ("docs/optimizer.md", "optimizer-state bytes per rank at dp {dp}, distributed over "
     "replicated, **{state_bytes_ratio:.3f}**; step time with overlapped over plain gradient "
     "reduce {overlap_step_time_ratio:.3f} in the latest run"),
]


def _cfg(dtype: str, **train) -> dict:
    return {"cluster": {"stages": [{"name": "s0", "device": "cpu", "tp": 1}], "dp": DP},
            "model": {**MODEL, "params_dtype": dtype},
            "train": {"micro_batch_size": MBS, "num_microbatches": M, "steps": STEPS, **train}}


def _state_bytes(stage_opt) -> int:
    """Bytes of the tensors the optimizer keeps besides the model: main params and moments."""
    from ldt.training.optim import _inner

    opt = _inner(stage_opt.optimizer).optimizer
    model = {p.data_ptr() for m in stage_opt.models for p in m.parameters()}
    tensors = {id(t): t for st in opt.state.values() for t in st.values()
               if hasattr(t, "nbytes") and t.dim() > 0}
    tensors.update({id(p): p for g in opt.param_groups for p in g["params"]
                    if p.data_ptr() not in model})
    return sum(t.nbytes for t in tensors.values())


def _worker(rank: int, world: int, cfg: dict, steps: int):

    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import ldt
    from ldt import patches
    from ldt.config import typed_config
    from ldt.training.optim import build_stage_optimizer
    from ldt.training.stage import build_stage_models, make_forward_step
    from ldt.topology.validate import validate

    c = typed_config(cfg)
    topo = validate(c.cluster, c.model, world_size=world, train=c.train)
    state = ldt.initialize_vtp(topo, timeout_s=60)
    names = ["cpu_shims", "optimizer_cpu", "schedules"]
    from ldt.pipeline.forward_backward import MegatronHooks

    patches.apply(names, ctx=MegatronHooks())
    try:
        models = build_stage_models(c, topo, state)
        opt = build_stage_optimizer(c, topo, state, models, shared_chunks=False)
        batches = make_batches(c.model, MBS, M, seed=7 + rank)
        forward_step = make_forward_step(c.model.seq_length)
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=opt.chunks[0],
                num_microbatches=M, seq_length=c.model.seq_length, micro_batch_size=MBS)
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return {"state_bytes": _state_bytes(opt), "step_times_s": times[2:] or times}
    finally:
        patches.revert(names)
        ldt.destroy_vtp()


def _run(cfg: dict, steps: int) -> dict:
    from ldt.launch.local import run_local_world

    return run_local_world(DP, _worker, (cfg, steps), timeout_s=600)[0]


def main() -> dict:
    load = machine_load()
    replicated = _run(_cfg("bfloat16", distributed_optimizer=False), 2)
    sharded = _run(_cfg("bfloat16", distributed_optimizer=True), 2)
    # megatron's DDP is built once per world with or without overlap, so each path is its own
    # world: runs in ABBA order (plain, overlap, overlap, plain), each run's first two steps
    # discarded, the median over the steps kept
    times = {"plain": [], "overlap": []}
    for name in ("plain", "overlap", "overlap", "plain"):
        # small buckets, so reduces start during the backward (megatron's DDP: overlap only)
        overlapped = {"overlap_grad_reduce": True, "ddp_bucket_size": 40000}
        run = _run(_cfg("float32", **(overlapped if name == "overlap" else {})), STEPS)
        times[name] += run["step_times_s"]
    plain, overlap = times["plain"], times["overlap"]
    out = {"bench": "optimizer", "dp": DP,
           "state_bytes_replicated": replicated["state_bytes"],
           "state_bytes_distributed": sharded["state_bytes"],
           "state_bytes_ratio": round(sharded["state_bytes"] / replicated["state_bytes"], 3),
           "step_time_s_no_overlap": round(median(plain), 4),
           "step_time_s_overlap": round(median(overlap), 4),
           "overlap_step_time_ratio": round(median(overlap) / median(plain), 3),
           "step_time_s_no_overlap_spread": spread(plain),
           "step_time_s_overlap_spread": spread(overlap)}
    print(f"optimizer state bytes per rank at dp {DP}: replicated "
          f"{out['state_bytes_replicated']}, distributed {out['state_bytes_distributed']} "
          f"(ratio {out['state_bytes_ratio']}); step time overlapped / not: "
          f"{out['overlap_step_time_ratio']}")
    return emit(out, load_before=load)


if __name__ == "__main__":
    main()
