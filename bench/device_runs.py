"""The device check's single-stage runs: a llama-style model on one GPU stage, trained by
``ldt-train``'s own worker (memory counters read between its steps) and by a plain
megatron-core loop (speed), on the same weights and micro-batches.

Memory: ldt-memory's estimate (:func:`ldt.memory.estimate`) against what the CUDA caching
allocator saw: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of every
step, read just before ldt's step guard resets them, and at the end the device's used
memory (``torch.cuda.mem_get_info``). What the estimate leaves out, in bytes: the CUDA
context and what lives outside the allocator (used - reserved), the allocator's cache and
fragmentation (reserved - allocated) and its rounding (allocated - requested).

Speed: four runs in ABBA order (ldt, megatron, megatron, ldt), each its own world, the first
steps of each discarded (allocator, cuBLAS heuristics); the ratio of median step times, and
the MFU of each (model FLOPs of :func:`ldt.training.outputs.model_flops_per_step` / step
time / the device's named peak).
"""

from __future__ import annotations

import os
import statistics

GIB = 2**30
WARMUP = 3  # steps of each run left out of its step time


def model_overrides(rehearse: bool, gpu_gib: float) -> list[str]:
    """A llama-style stage of ~1.1B parameters (TinyLlama's shape: hidden 2048, 22 layers,
    32 heads in 4 KV groups, SwiGLU 5632, vocabulary 32000), fewer layers on a GPU of less
    than 70 GiB (``gpu_gib``; about a quarter of it); the rehearsal trains llama_tiny."""
    if rehearse:
        return ["model=llama_tiny", "model.params_dtype=bfloat16", "train.micro_batch_size=2",
                "train.num_microbatches=4"]
    layers = 22 if gpu_gib >= 70 else max(2, int(22 * gpu_gib / 80))
    return ["model=llama_tiny", f"model.num_layers={layers}", "model.hidden_size=2048",
            "model.num_attention_heads=32", "model.num_query_groups=4",
            "model.ffn_hidden_size=5632", "model.vocab_size=32000", "model.seq_length=1024",
            "model.max_position_embeddings=1024", "model.params_dtype=bfloat16",
            "train.micro_batch_size=2", "train.num_microbatches=4"]


def one_stage_config(device: str, rehearse: bool, steps: int, gpu_gib: float) -> dict:
    """The composed config (a plain dict) of one stage on ``device`` holding the whole model."""
    from omegaconf import OmegaConf

    from ldt.job.hydra import compose

    cfg = OmegaConf.to_container(compose(
        model_overrides(rehearse, gpu_gib) + [f"train.steps={steps}", "train.tensorboard=false",
                                             "train.warmup_steps=2", "data.max_bytes=8000000"]),
        resolve=True)
    cfg["cluster"] = {"stages": [{"name": "gpu", "device": device, "tp": 1}],
                      "u_shape": False, "layout": None, "dp": 1}
    return cfg


def parameters(cfg: dict) -> int:
    from ldt.config import to_model
    from ldt.models.arch import full_shapes

    import math

    return sum(math.prod(shape) for shape in full_shapes(to_model(cfg["model"])).values())


# ---- memory --------------------------------------------------------------------------------

def instrumented_worker(rank: int, world: int, cfg: dict, run_dir: str) -> dict:
    """``ldt-train``'s worker with the allocator's peaks of every step recorded just before
    its step guard resets them (:func:`ldt.training.guard.peak_memory_gib`)."""
    import torch

    from ldt.training import loop

    steps: list = []
    original = loop.peak_memory_gib

    def recording(device: str) -> float:
        if device == "cuda":
            stats = torch.cuda.memory_stats()
            steps.append({"allocated": torch.cuda.max_memory_allocated(),
                          "reserved": torch.cuda.max_memory_reserved(),
                          "requested": stats.get("requested_bytes.all.peak")})
            return original(device)
        gib = original(device)  # the CPU: the process's resident peak (VmHWM)
        steps.append({"resident": int(gib * GIB)})
        return gib

    loop.peak_memory_gib = recording
    try:
        summary = loop.train_worker(rank, world, cfg, run_dir)
    finally:
        loop.peak_memory_gib = original
    out = {"summary": summary, "steps": steps}
    if torch.cuda.is_available() and cfg["cluster"]["stages"][0]["device"] == "cuda":
        free, total = torch.cuda.mem_get_info()
        out.update(device_used=total - free, device_total=total,
                   reserved_at_end=torch.cuda.memory_reserved())
    return out


def memory(device: str, rehearse: bool, out_dir: str, status, gpu_gib: float) -> dict:
    from bench.device_checks import fresh
    from ldt.config import to_model
    from ldt.launch.local import run_local_world
    from ldt.memory import estimate
    from ldt.models.spec import TE, transformer_impl

    cfg = one_stage_config(device, rehearse, steps=4, gpu_gib=gpu_gib)
    # the attention this machine's run has (ldt-memory's "auto" assumes Transformer Engine's
    # fused attention on a cuda stage, which the lent machine lacks: its layers are local)
    impl = transformer_impl(to_model(cfg["model"]), device)
    (est,) = estimate(cfg, attention="flash" if impl == TE else "local")
    run_dir = fresh(os.path.join(out_dir, "runs", "memory"))
    got = run_local_world(1, instrumented_worker, (cfg, run_dir), timeout_s=600)[0]
    out = {"parameters": parameters(cfg), "layers": impl, "attention": est.attention,
           "estimate_gib": est.peak / GIB,
           "estimate_parts_gib": {k: v / GIB for k, v in est.components().items()},
           "steps": got["steps"], "final_loss": got["summary"]["final_loss"],
           "first_loss": got["summary"]["first_loss"]}
    if device == "cuda":
        allocated = max(s["allocated"] for s in got["steps"])
        reserved = max(s["reserved"] for s in got["steps"])
        requested = max(s["requested"] or 0 for s in got["steps"])
        out.update(allocated_peak_gib=allocated / GIB, reserved_peak_gib=reserved / GIB,
                   estimate_over_allocated=round(est.peak / allocated, 4),
                   estimate_over_reserved=round(est.peak / reserved, 4),
                   left_out_gib={
                       "context_and_outside_the_allocator":
                           (got["device_used"] - got["reserved_at_end"]) / GIB,
                       "allocator_cache_and_fragmentation": (reserved - allocated) / GIB,
                       "allocator_rounding": (allocated - requested) / GIB if requested
                       else None},
                   gpu_share=round(reserved / got["device_total"], 3))
        ok = 0.8 <= est.peak / allocated <= 1.25
    else:  # the rehearsal: the process's resident set, torch's libraries included
        resident = max(s["resident"] for s in got["steps"])
        out.update(resident_peak_gib=resident / GIB,
                   estimate_over_resident=round(est.peak / resident, 4))
        ok = resident > 0 and est.peak > 0
    return dict(out, status=status(ok))


# ---- speed ---------------------------------------------------------------------------------

def ldt_worker(rank: int, world: int, cfg: dict, run_dir: str) -> dict:
    """``ldt-train``'s worker; its step times from the run's metrics.csv."""
    import csv

    from ldt.training.loop import train_worker

    summary = train_worker(rank, world, cfg, run_dir)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return {"times": [float(r["step_time_s"]) for r in rows],
            "losses": [float(r["loss"]) for r in rows], "final_loss": summary["final_loss"]}


def megatron_worker(rank: int, world: int, cfg: dict) -> dict:
    """The same stage as a Megatron script trains it: megatron's parallel_state, GPTModel,
    Float16Module, DistributedDataParallel, get_megatron_optimizer, its lr scheduler and its
    no-pipelining schedule; the weights (ldt's layout-invariant init) and the micro-batches
    (ldt's TextData) are ldt's, so the first losses agree. Timed as ldt times a step: from
    after zero_grad to the loss on the host."""
    import time

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from ldt import patches
    from ldt.data.bytes import TextData
    from ldt.config import typed_config
    from ldt.models.build import build_chunk, param_names
    from ldt.models.init import init_chunk
    from ldt.models.vocab import model_vocab_size
    from ldt.training.optim import optimizer_config
    from ldt.training.stage import make_forward_step
    from ldt.topology.validate import validate

    c = typed_config(cfg)
    device = cfg["cluster"]["stages"][0]["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:  # the rehearsal: megatron on the CPU needs ldt's CPU shims (as bench_vtp_overhead)
        dist.init_process_group("gloo")
        patches.apply(["cpu_shims", "optimizer_cpu", "rope_cpu"])
    t = c.train
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    topo = validate(c.cluster, c.model, world_size=1, train=t)
    chunk = topo.split.stage_chunks(0)[0]
    gpt = build_chunk(c.model, chunk, 1, device=device, vocab_size=model_vocab_size(c.model, topo))
    init_chunk(gpt, seed=t.seed, num_layers=c.model.num_layers, tp=1, tp_rank=0,
               rename=param_names(chunk, gpt).__getitem__, vocab_size=c.model.vocab_size)
    bf16 = gpt.config.bf16
    module = Float16Module(gpt.config, gpt) if bf16 else gpt
    ddp = DistributedDataParallel(
        config=gpt.config, module=module,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=t.overlap_grad_reduce,
            bucket_size=t.ddp_bucket_size, average_in_collective=False))
    opt = get_megatron_optimizer(optimizer_config(c), [ddp], use_gloo_process_groups=False)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.warmup_steps,
        lr_decay_steps=max(t.steps, t.warmup_steps + 1), lr_decay_style="cosine",
        start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=t.steps,
        wd_incr_style="constant")
    sched.step(increment=1)  # as ldt: step 0 trains at the first warmup value
    gpt.config.grad_scale_func = opt.scale_loss
    gpt.config.finalize_model_grads_func = finalize_model_grads
    data = TextData(c.data.path, c.model.seq_length, t.micro_batch_size, t.num_microbatches,
                    seed=t.seed, max_bytes=c.data.max_bytes, vocab_size=c.model.vocab_size)
    forward_step = make_forward_step(c.model.seq_length, torch.device(device))
    times, losses = [], []
    for step in range(t.steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        t0 = time.perf_counter()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data.step_iterator(step),
            model=[ddp], num_microbatches=t.num_microbatches, seq_length=c.model.seq_length,
            micro_batch_size=t.micro_batch_size, forward_only=False)
        applied, _, _ = opt.step()
        if applied:
            sched.step(increment=1)
        losses.append(float(torch.stack([x["lm loss"].float() for x in out]).mean().item()))
        times.append(time.perf_counter() - t0)
    if device == "cpu":
        patches.revert()
    ps.destroy_model_parallel()
    return {"times": times, "losses": losses}


def speed(device: str, rehearse: bool, out_dir: str, status, peak, gpu_gib: float) -> dict:
    from bench.device_checks import fresh, save
    from ldt.config import to_model
    from ldt.launch.local import run_local_world
    from ldt.training.outputs import model_flops_per_step

    steps = WARMUP + (3 if rehearse else 8)
    cfg = one_stage_config(device, rehearse, steps=steps, gpu_gib=gpu_gib)
    runs = []
    for i, path in enumerate(("ldt", "megatron", "megatron", "ldt")):
        if path == "ldt":
            run_dir = fresh(os.path.join(out_dir, "runs", f"speed_{i}_ldt"))
            got = run_local_world(1, ldt_worker, (cfg, run_dir), timeout_s=600)[0]
        else:
            got = run_local_world(1, megatron_worker, (cfg,), timeout_s=600, init_dist=False,
                                  env={"TORCHELASTIC_USE_AGENT_STORE": "True"})[0]
        runs.append(dict(got, path=path, median_s=statistics.median(got["times"][WARMUP:])))
        save({"status": "partial", "runs": runs})
        print(f"speed: run {i} {path}: step times {[round(x, 4) for x in got['times']]}",
              flush=True)
    t = cfg["train"]
    flops = model_flops_per_step(to_model(cfg["model"]), t["micro_batch_size"],
                                 t["num_microbatches"])
    med = {p: statistics.median(x for r in runs if r["path"] == p for x in r["times"][WARMUP:])
           for p in ("ldt", "megatron")}
    tflops, peak_label = peak
    out = {"ldt_over_megatron": round(med["ldt"] / med["megatron"], 4),
           "pairs": [round(runs[0]["median_s"] / runs[1]["median_s"], 4),
                     round(runs[3]["median_s"] / runs[2]["median_s"], 4)],
           "ldt_step_s": med["ldt"], "megatron_step_s": med["megatron"],
           "model_tflop_per_step": flops / 1e12, "parameters": parameters(cfg),
           "tokens_per_step": t["micro_batch_size"] * t["num_microbatches"]
           * cfg["model"]["seq_length"],
           "first_loss": {"ldt": runs[0]["losses"][0], "megatron": runs[1]["losses"][0]},
           "peak": peak_label, "warmup_steps_discarded": WARMUP, "steps_per_run": steps,
           "runs": [{k: r[k] for k in ("path", "times", "losses")} for r in runs]}
    if tflops and not rehearse:
        out.update(mfu_ldt=round(flops / med["ldt"] / (tflops * 1e12), 4),
                   mfu_megatron=round(flops / med["megatron"] / (tflops * 1e12), 4))
    same_model = abs(runs[0]["losses"][0] - runs[1]["losses"][0]) <= (
        0.05 if cfg["model"]["params_dtype"] != "float32" else 1e-4)
    out["same_first_loss"] = same_model
    return dict(out, status=status(same_model))
