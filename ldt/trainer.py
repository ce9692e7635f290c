"""The training loop of one rank: build its stage, then step.

Flow (one owner per piece): config -> :func:`ldt.validate.validate` (topology) ->
:func:`ldt.parallel_state.initialize_vtp` (groups) -> :mod:`ldt.model` + :mod:`ldt.init`
(this stage's chunks) -> schedule (megatron's 1F1B / interleaved through the patched
``get_forward_backward_func``, or ldt's U-shape runtime) -> :mod:`ldt.optim` (DP all-reduce,
global norm, clip) -> AdamW step. Only data stages build a :class:`~ldt.data.TextData`.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import time
from types import SimpleNamespace
from typing import Any, Optional

import torch

from ldt.config import DataConfig, TrainConfig, to_cluster, to_model

REPORT_KEYS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "eval_loss")
# action_times.csv (ldt runtime only): every action of every step and stage; start_s / end_s are
# relative to that stage's step start, which is step_start_s on the clock of `host`.
ACTION_TIMES_KEYS = ("step", "stage", "action", "start_s", "end_s", "host", "step_start_s")


def make_forward_step(seq_length: int):
    """Megatron-style forward_step_func; stages without data get ``data_iterator=None``."""
    from ldt.model import causal_mask

    mask = causal_mask(seq_length)

    def forward_step(data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        if batch is None:
            return model(None, None, mask), _loss_func(None)
        out = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return out, _loss_func(batch["loss_mask"])

    return forward_step


def _loss_func(loss_mask):
    def loss_func(output_tensor):
        lm = loss_mask if loss_mask is not None else torch.ones_like(output_tensor)
        loss = (output_tensor.float() * lm).sum() / lm.sum()
        return loss, {"lm loss": loss.clone().detach()}  # clone: the schedule divides in place

    return loss_func


def parse(cfg: dict) -> SimpleNamespace:
    return SimpleNamespace(cluster=to_cluster(cfg["cluster"]), model=to_model(cfg["model"]),
                           train=TrainConfig(**cfg["train"]),
                           data=DataConfig(**cfg.get("data", {})),
                           reference=bool(cfg.get("reference", False)))


def train_worker(rank: int, world: int, cfg: dict, run_dir: str) -> Optional[dict]:
    """Train on this rank; the loss stage's leader of replica 0 returns the summary."""
    import ldt
    from ldt import patches
    from ldt.validate import validate

    c = parse(cfg)
    topo = validate(c.cluster, c.model, world_size=world, train=c.train)
    _record_pid(run_dir, rank)
    state = ldt.initialize_vtp(topo, timeout_s=c.train.comm_timeout_s)
    stage = topo.stages[state.stage]
    observers = _observers(c.train, run_dir, rank)
    names = (["cpu_shims"] if stage.device == "cpu" else []) + ["schedules"]
    patches.apply(names, ctx=SimpleNamespace(observers=observers))
    try:
        return _train(rank, c, topo, state, observers, run_dir)
    finally:
        patches.revert(names)
        ldt.destroy_vtp()


def _record_pid(run_dir: str, rank: int) -> None:
    """``run_dir/pids/rank_<r>`` holds the rank's process id (which process is rank r?)."""
    folder = os.path.join(run_dir, "pids")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{rank}"), "w") as f:
        f.write(f"{os.getpid()}\n")


def _observers(train: TrainConfig, run_dir: str, rank: int) -> list:
    from ldt.observe import CommAudit, FiniteCheck

    out: list = []
    if train.audit_comm:
        out.append(CommAudit(os.path.join(run_dir, "comm_audit.jsonl"), rank))
    if train.check_finite if train.check_finite is not None else train.verify:
        out.append(FiniteCheck())
    return out


def build_stage_models(c, topo, state) -> list:
    from megatron.core import tensor_parallel

    from ldt.init import init_chunk
    from ldt.model import build_chunk, global_param_name

    tensor_parallel.model_parallel_cuda_manual_seed(c.train.seed)
    chunks = topo.split.stage_chunks(state.stage)
    vpp = len(chunks) if len(chunks) > 1 and not topo.u_shape else None
    stage = topo.stages[state.stage]
    models = []
    for chunk in chunks:
        gpt = build_chunk(c.model, chunk, stage.tp, device=stage.device, vpp=vpp,
                          num_stages=topo.num_stages, pg_collection=state.pg_collection())
        init_chunk(gpt, seed=c.train.seed, num_layers=c.model.num_layers, tp=stage.tp,
                   tp_rank=state.info.tp_rank, rename=lambda n, ch=chunk: global_param_name(ch, n))
        gpt.config.overlap_p2p_comm = bool(c.train.overlap_p2p_comm and vpp)
        gpt.config.batch_p2p_comm = not gpt.config.overlap_p2p_comm
        models.append(gpt)
    if c.model.tie_embeddings and any(ch.has_embedding for ch in chunks):
        tie_embeddings(chunks, models)
    return models


def tie_embeddings(chunks, models) -> None:
    """Share the input embedding with the output head. Validation guarantees both sit on
    this stage (U-shape edge or a one-stage model), so no cross-stage group is needed: the
    head chunk just uses the embedding's parameter, and both gradients accumulate into it."""
    emb = next(g for ch, g in zip(chunks, models) if ch.has_embedding)
    head = next(g for ch, g in zip(chunks, models) if ch.has_head)
    head.output_layer.weight = emb.embedding.word_embeddings.weight


def _train(rank, c, topo, state, observers, run_dir) -> Optional[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ldt.data import TextData
    from ldt.optim import allreduce_dp_grads, clip_grads, global_grad_norm, lr_lambda
    from ldt.pipeline import run_step

    from ldt import checkpoint

    t, m = c.train, c.train.num_microbatches
    models = build_stage_models(c, topo, state)
    chunks = topo.split.stage_chunks(state.stage)
    params = list({id(p): p for g in models for p in g.parameters()}.values())  # tied: once
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.warmup_steps, t.steps, t.lr, t.min_lr))
    first_step = 0
    if t.resume:
        first_step = checkpoint.load(t.resume, models, chunks, opt, state)
        sched.last_epoch = first_step - 1
        sched.step()  # learning rate of first_step
    data = None
    if state.stage in topo.data_stages():
        data = TextData(c.data.path, c.model.seq_length, t.micro_batch_size, m,
                        dp_rank=state.info.dp_rank, dp=topo.dp, seed=t.seed,
                        max_bytes=c.data.max_bytes, vocab_size=c.model.vocab_size)
    reporter = state.stage == topo.loss_stage() and state.is_leader and state.info.dp_rank == 0
    if rank == 0 and not c.reference:
        print(topo.rank_map(), flush=True)
    forward_step = make_forward_step(c.model.seq_length)
    tokens_per_step = topo.dp * m * t.micro_batch_size * c.model.seq_length
    rows, timings = [], []  # timings: per step, (step start, this stage's (action, start, end))
    ldt_runtime = uses_ldt_runtime(t, topo)
    bar = _progress(t.steps - first_step, reporter)

    def pipeline_pass(make_iterator, forward_only: bool = False):
        """One pass of the schedule over m micro-batches -> (loss stage's losses, timings)."""
        iters = [None] * len(models) if data is None else [make_iterator() for _ in models]
        if ldt_runtime:
            from ldt.p2p import VtpCommunicator

            comm = VtpCommunicator(models[0].config, state, observers)
            res = run_step(forward_step_func=forward_step, data_iterator=iters[0],
                           model=models, num_microbatches=m, seq_length=c.model.seq_length,
                           micro_batch_size=t.micro_batch_size, comm=comm, state=state,
                           config=models[0].config, record_timings=not forward_only,
                           forward_only=forward_only)
            return res.losses, res.timings
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters if len(models) > 1 else iters[0],
            model=models if len(models) > 1 else models[0], num_microbatches=m,
            seq_length=c.model.seq_length, micro_batch_size=t.micro_batch_size,
            forward_only=forward_only), []

    for step in range(first_step, t.steps):
        for obs in observers:
            obs.new_step(step)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        losses, timed = pipeline_pass(lambda: data.step_iterator(step))
        if ldt_runtime:
            timings.append((t0, [(str(a), s - t0, e - t0) for a, s, e in timed]))
        allreduce_dp_grads(params, state)
        norm = global_grad_norm(params, state)
        clip_grads(params, t.clip_grad, norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        loss = _mean_loss(losses, state) if state.stage == topo.loss_stage() else None
        dt = time.perf_counter() - t0
        row = dict(step=step, loss=loss, lr=lr, grad_norm=norm, step_time_s=dt,
                   tokens_per_s=tokens_per_step / dt, eval_loss=None)
        if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            with torch.no_grad():  # as megatron's evaluate(): held-out data, no graph, no grads
                eval_losses, _ = pipeline_pass(data.eval_iterator if data else None, True)
            if state.stage == topo.loss_stage():
                row["eval_loss"] = _mean_loss(eval_losses, state)
        rows.append(row)
        if t.save_every and (step + 1) % t.save_every == 0:
            checkpoint.save(run_dir, step, models, chunks, opt, state)
        if reporter:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            step_s=f"{dt:.3f}")
    bar.close()
    timeline = _gather_timings(timings, state) if ldt_runtime else None
    if not reporter:
        return None
    _write_outputs(run_dir, rows, timeline, topo)
    if not rows:
        return {"steps": t.steps, "first_step": first_step, "losses": [], "run_dir": run_dir}
    steady = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]
    step_time = sorted(steady)[len(steady) // 2]
    evals = [r["eval_loss"] for r in rows if r["eval_loss"] is not None]
    return {"steps": t.steps, "first_step": first_step, "final_loss": rows[-1]["loss"],
            "first_loss": rows[0]["loss"], "losses": [r["loss"] for r in rows],
            "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
            **({"eval_loss": evals[-1], "eval_losses": evals} if evals else {}),
            "run_dir": run_dir}


def _mean_loss(losses, state) -> float:
    import torch.distributed as dist

    value = torch.stack([x["lm loss"].float() for x in losses]).mean().reshape(1).cpu()
    if state.topology.dp > 1:  # every replica's loss stage, same (stage, TP rank) group
        dist.all_reduce(value, group=state.dp_group_gloo)
        value /= state.topology.dp
    return float(value.item())


def _progress(total: int, enabled: bool):
    """tqdm on the reporting rank only (a disabled tqdm still allocates a process lock)."""
    if not enabled:
        return SimpleNamespace(update=lambda n: None, set_postfix=lambda **kw: None,
                               close=lambda: None)
    import threading

    from tqdm import tqdm

    # a thread lock: tqdm's default multiprocessing lock would outlive this worker's os._exit
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc="ldt-train", unit="step", dynamic_ncols=True, mininterval=0.5)


def uses_ldt_runtime(train: TrainConfig, topo) -> bool:
    """The U-shape always runs on ldt's runtime; a plain pipeline when train.runtime=ldt."""
    return topo.u_shape or train.runtime == "ldt"


def _gather_timings(timings, state):
    """Every stage leader's host and measured per-action times of every step (for the loss
    leader). Step starts are ``perf_counter`` values: one clock for all processes of a host
    (Linux CLOCK_MONOTONIC), so stages on one host can be lined up against each other."""
    import torch.distributed as dist

    if not state.is_leader or state.leader_group is None:
        return None
    gathered: list[Any] = [None] * state.topology.num_stages
    dist.all_gather_object(gathered, (socket.gethostname(), timings), group=state.leader_group)
    return gathered  # [stage] -> (host, [step] -> (step_start, [(action, start_s, end_s)]))


def _write_outputs(run_dir: str, rows: list, timeline, topo) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REPORT_KEYS)
        w.writeheader()
        w.writerows(rows)
    if timeline:
        from ldt.schedule.timeline import result_from_measurements, to_chrome_trace, to_png

        with open(os.path.join(run_dir, "action_times.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(ACTION_TIMES_KEYS)
            for stage, (host, steps) in enumerate(timeline):
                for i, (step_start, step_rows) in enumerate(steps):
                    w.writerows((rows[i]["step"], stage, a, s, e, host, step_start)
                                for a, s, e in step_rows)
        last = [steps[-1] for _, steps in timeline]  # per stage: (step start, rows)
        one_clock = len({host for host, _ in timeline}) == 1  # else stages' starts don't compare
        offsets = [start - min(s for s, _ in last) for start, _ in last] if one_clock else None
        result = result_from_measurements([step_rows for _, step_rows in last], offsets)
        to_chrome_trace(result, os.path.join(run_dir, "timeline.json"))
        to_png(result, os.path.join(run_dir, "timeline.png"),
               f"measured last step, {topo.num_stages} stages, TP {topo.tp_sizes}")


def reference_config(cfg: dict) -> dict:
    """The single-process reference of ``train.verify``: one stage, TP 1, the same global batch."""
    ref = json.loads(json.dumps(cfg))
    dp = int(cfg["cluster"].get("dp", 1))
    ref["cluster"] = {"stages": [{"name": "reference", "device": "cpu", "tp": 1}],
                      "u_shape": False, "layout": None, "dp": 1}
    ref["train"]["num_microbatches"] = dp * int(cfg["train"]["num_microbatches"])
    ref["train"].update(audit_comm=False, schedule="auto", overlap_p2p_comm=False)
    ref["reference"] = True
    return ref

