"""The training loop of one rank: build its stage, then step.

Flow (one owner per piece): config -> :func:`ldt.validate.validate` (topology) ->
:func:`ldt.parallel_state.initialize_vtp` (groups) -> :mod:`ldt.models.build` + :mod:`ldt.models.init`
(this stage's chunks) -> schedule (megatron's 1F1B / interleaved through the patched
``get_forward_backward_func``, or ldt's U-shape runtime) -> :mod:`ldt.training.optim`
(megatron-core's DDP gradient reduce, ``finalize_model_grads``, optimizer with the global norm
and clipping, lr schedule). Only data stages build a :class:`~ldt.data.bytes.TextData`.
After every step all ranks agree (:mod:`ldt.training.guard`) whether to stop (a signal, a
non-finite loss, a failed save), so they stop together; the reporting rank writes the step's
row (:mod:`ldt.training.outputs`) as it ends. Every phase is marked in this rank's progress
record (:mod:`ldt.progress`), which names the rank a hang waits for.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from ldt import progress
from ldt.config import DataConfig, TrainConfig, to_cluster, to_model, to_train
from ldt.training.guard import (StepGuard, StopSignals, nonfinite_stop, peak_memory_gib,
                                save_failed_stop, signal_stop)
from ldt.training.outputs import gather_timings, mtp_keys, write_outputs
from ldt.training.stage import build_stage_models, make_forward_step


def parse(cfg: dict) -> SimpleNamespace:
    return SimpleNamespace(cluster=to_cluster(cfg["cluster"]), model=to_model(cfg["model"]),
                           train=to_train(cfg["train"]),
                           data=DataConfig(**cfg.get("data", {})),
                           reference=bool(cfg.get("reference", False)))


def train_worker(rank: int, world: int, cfg: dict, run_dir: str,
                 resume_verified: bool = False,
                 observe: Optional[Callable] = None) -> Optional[dict]:
    """Train on this rank; the loss stage's leader of replica 0 returns the summary (with
    ``stopped``, a :class:`~ldt.training.guard.Stop`, when the run ended early).
    ``resume_verified``: the launcher already checked the checkpoint's checksums
    (``train.resume`` / ``train.load``). ``observe(rank, topo, run_dir)`` (module-level) adds
    boundary observers (ldt-audit's)."""
    import ldt
    from ldt import patches
    from ldt.device import rank_device, use_device
    from ldt.quiet import set_log_level
    from ldt.validate import validate

    c = parse(cfg)
    set_log_level(c.train.log_level, rank)  # the same under torchrun as in a bare launch
    topo = validate(c.cluster, c.model, world_size=world, train=c.train)
    _record_pid(run_dir, rank)
    use_device(rank_device(topo, rank))  # before any group or tensor: megatron's current device
    with StopSignals() as signals:  # from here on a stop signal waits for a step boundary
        state = ldt.initialize_vtp(topo, timeout_s=c.train.comm_timeout_s)
        guard = StepGuard(state, signals, StepGuard.world_group())
        stage = topo.stages[state.stage]
        observers = _observers(c.train, run_dir, rank)
        if observe is not None:
            observers += observe(rank, topo, run_dir)
        cpu = ["cpu_shims", "optimizer_cpu", "rope_cpu"] if stage.device == "cpu" else []
        names = cpu + ["schedules", "sequence_parallel_norms", "recompute_norms",
                       "moe_without_te"] + (["wgrad_split"] if c.train.schedule == "zb" else [])
        from ldt.schedule.forward_backward import MegatronHooks

        patches.apply(names, ctx=MegatronHooks(tuple(observers)))
        try:
            return _train(rank, c, topo, state, observers, run_dir, guard, resume_verified)
        finally:
            for obs in observers:  # the audit's message tap unwraps torch.distributed
                getattr(obs, "close", lambda: None)()
            patches.revert(names)
            ldt.destroy_vtp()


def _record_pid(run_dir: str, rank: int) -> None:
    """``run_dir/pids/rank_<r>`` holds the rank's process id (which process is rank r?)."""
    folder = os.path.join(run_dir, "pids")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{rank}"), "w") as f:
        f.write(f"{os.getpid()}\n")


def _observers(train: TrainConfig, run_dir: str, rank: int) -> list:
    from ldt.training.observe import CommAudit, FiniteCheck

    out: list = []
    if train.audit_comm:
        out.append(CommAudit(os.path.join(run_dir, "comm_audit.jsonl"), rank))
    if train.check_finite if train.check_finite is not None else train.verify:
        out.append(FiniteCheck())
    return out


def _train(rank, c, topo, state, observers, run_dir, guard, resume_verified) -> Optional[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ldt.data import build_training_data
    from ldt.device import rank_device
    from ldt.privacy.defence import send_transforms
    from ldt.training.optim import build_stage_optimizer, skip_to
    from ldt.schedule.forward_backward import run_step

    from ldt.training import checkpoint, moe

    t, m = c.train, c.train.num_microbatches
    record = progress.current()
    record.begin("building the model and optimizer")
    models = build_stage_models(c, topo, state)
    chunks = topo.split.stage_chunks(state.stage)
    shared = len({id(p) for g in models for p in g.parameters()}) < \
        sum(1 for g in models for _ in g.parameters())  # U-shape edge: tied embedding + head
    opt = build_stage_optimizer(c, topo, state, models, shared_chunks=shared)
    first_step = 0
    if t.resume:
        record.begin("loading the checkpoint")
        first_step = checkpoint.load(t.resume, models, chunks, opt, state,
                                     verified=resume_verified)
        skip_to(opt, first_step)  # learning rate of first_step
    elif t.load:  # weights only (e.g. an imported Hugging Face model): step 0, fresh optimizer
        record.begin("loading the checkpoint")
        checkpoint.load(t.load, models, chunks, opt, state, verified=resume_verified,
                        weights_only=True)
    models = opt.chunks  # what the schedule runs: DDP (and Float16Module) wrapped
    data = build_training_data(c, topo, state)  # every rank: indexed data builds collectively
    reporter = state.stage == topo.loss_stage() and state.is_leader and state.info.dp_rank == 0
    forward_step = make_forward_step(c.model.seq_length, rank_device(topo, rank))
    tokens_per_step = topo.dp * m * t.micro_batch_size * c.model.seq_length
    rows, timings = [], []  # timings: per step, (step start, this stage's (action, start, end))
    ldt_runtime = uses_ldt_runtime(t, topo)
    out = _Outputs(c, topo, run_dir, first_step) if reporter else None
    device = topo.stages[state.stage].device
    info = {"steps": t.steps}  # checkpoint.json; the model goes to model.json
    transforms = send_transforms(t, topo, state.stage)  # once per run: one noise stream
    stop = None

    def pipeline_pass(make_iterator, forward_only: bool = False):
        """One pass of the schedule over m micro-batches -> (loss stage's losses, timings)."""
        iters = [None] * len(models) if data is None else [make_iterator() for _ in models]
        if ldt_runtime:
            from ldt.boundary.communicator import VtpCommunicator

            comm = VtpCommunicator(models[0].config, state, observers, transforms)
            res = run_step(forward_step_func=forward_step, data_iterator=iters[0],
                           model=models, num_microbatches=m, seq_length=c.model.seq_length,
                           micro_batch_size=t.micro_batch_size, comm=comm, state=state,
                           config=models[0].config, record_timings=not forward_only,
                           forward_only=forward_only, prefetch=t.prefetch,
                           zero_bubble=t.schedule == "zb")
            return res.losses, res.timings
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iters if len(models) > 1 else iters[0],
            model=models if len(models) > 1 else models[0], num_microbatches=m,
            seq_length=c.model.seq_length, micro_batch_size=t.micro_batch_size,
            forward_only=forward_only), []

    for step in range(first_step, t.steps):
        record.step(step)
        for obs in observers:
            obs.new_step(step)
        opt.zero_grad()
        t0 = time.perf_counter()
        record.begin("forward-backward" + ("" if ldt_runtime else " (megatron's schedule)"))
        moe.reset(c.model)
        _reset_mtp_losses()  # an evaluation pass (training mode, no graph) adds to them too
        losses, timed = pipeline_pass(lambda: data.step_iterator(step))
        if ldt_runtime:
            timings.append((t0, [(str(a), s - t0, e - t0) for a, s, e in timed]))
        record.begin("grad reduce (data-parallel, tied embedding), global norm, optimizer step",
                     waiting=True)
        lr, norm, _ = opt.step()
        loss = None
        if state.stage == topo.loss_stage():
            record.begin("loss all-reduce", waiting=True)
            loss = _mean_loss(losses, state)
            mtp = _mtp_losses(state, len(losses), c.model.mtp_num_layers)
        dt = time.perf_counter() - t0
        row = dict(step=step, loss=loss, lr=lr, grad_norm=norm, step_time_s=dt,
                   tokens_per_s=tokens_per_step / dt, eval_loss=None)
        if moe.tracks_aux_loss(c.model):
            record.begin("MoE load-balancing loss all-reduce", waiting=True)
            row["moe_aux_loss"] = moe.aux_loss(c.model, topo.dp * m, guard.group)
        if c.model.mtp_num_layers and loss is not None:
            row.update(zip(mtp_keys(c.model.mtp_num_layers), mtp))
        if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            record.begin("evaluation")
            with torch.no_grad():  # as megatron's evaluate(): held-out data, no graph, no grads
                eval_losses, _ = pipeline_pass(data.eval_iterator if data else None, True)
            if state.stage == topo.loss_stage():
                row["eval_loss"] = _mean_loss(eval_losses, state)
        record.begin("step boundary", waiting=True)
        decision = guard.agree(loss=loss, grad_norm=norm, peak_gib=peak_memory_gib(device))
        rows.append(row)
        if out is not None:
            out.step(row, decision)
        if decision.nonfinite and t.stop_on_nonfinite:
            stop = nonfinite_stop(decision, step, loss, norm,
                                  _stage_name(topo, topo.loss_stage()), checkpoint.latest(run_dir))
            break
        saved = None
        if t.save_every and ((step + 1) % t.save_every == 0 or decision.signum):
            record.begin("saving a checkpoint", waiting=True)
            result = checkpoint.save(run_dir, step, opt.models, chunks, opt, state, info=info,
                                     model=c.model, keep_last=t.keep_last, group=guard.group,
                                     origin=t.resume or t.load)
            if result.error:
                stop = save_failed_stop(result.error, step, checkpoint.latest(run_dir), run_dir)
                break
            saved = result.path
        if decision.signum:
            stop = signal_stop(decision.signum, step, saved, t.save_every,
                               checkpoint.latest(run_dir), run_dir)
            break
    record.begin("writing outputs")
    if out is not None:
        out.close()
    timeline = gather_timings(timings, state) if ldt_runtime else None
    if not reporter:
        return None
    write_outputs(run_dir, rows, timeline, topo)
    extra = {"stopped": stop} if stop is not None else {}
    if not rows:
        return {"steps": t.steps, "first_step": first_step, "losses": [], "run_dir": run_dir,
                **extra}
    steady = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]
    step_time = sorted(steady)[len(steady) // 2]
    evals = [r["eval_loss"] for r in rows if r["eval_loss"] is not None]
    aux = [r["moe_aux_loss"] for r in rows if r.get("moe_aux_loss") is not None]
    return {"steps": t.steps, "first_step": first_step, "final_loss": rows[-1]["loss"],
            "first_loss": rows[0]["loss"], "losses": [r["loss"] for r in rows],
            **_mtp_summary(rows, c.model.mtp_num_layers),
            "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
            **({"eval_loss": evals[-1], "eval_losses": evals} if evals else {}),
            **({"moe_aux_loss": aux[-1], "moe_aux_losses": aux} if aux else {}),
            "run_dir": run_dir, **extra}


class _Outputs:
    """The reporting rank's outputs of every step: metrics.csv, TensorBoard, the console."""

    def __init__(self, c, topo, run_dir: str, first_step: int):
        from ldt.training.outputs import (REPORT_KEYS, Console, MetricsLog, TensorBoard,
                                          memory_keys, model_flops_per_step, peak_flops)

        t = c.train
        from ldt.training.moe import tracks_aux_loss

        self.memory_keys = memory_keys(topo.num_stages)
        moe = ["moe_aux_loss"] if tracks_aux_loss(c.model) else []
        self.metrics = MetricsLog(run_dir, [*REPORT_KEYS, *mtp_keys(c.model.mtp_num_layers), *moe,
                                            *self.memory_keys], first_step)
        self.board = TensorBoard(run_dir, first_step, t.log_interval) if t.tensorboard else None
        self.console = Console(first_step, t.steps, t.log_interval)
        self.flops = model_flops_per_step(c.model, t.micro_batch_size,
                                          topo.dp * t.num_microbatches)
        self.peak = peak_flops(topo, t.peak_tflops)
        self.devices = topo.world_size

    def step(self, row: dict, decision) -> None:
        dt = row["step_time_s"]
        row["tflops_per_device"] = self.flops / dt / self.devices / 1e12
        row["mfu"] = self.flops / dt / self.peak if self.peak else None
        row.update(zip(self.memory_keys, decision.peak_memory_gib))
        self.metrics.append(row)
        if self.board is not None:
            self.board.add(row)
        self.console.update(row)

    def close(self) -> None:
        self.metrics.close()
        if self.board is not None:
            self.board.close()
        self.console.close()


def _stage_name(topo, stage: int) -> str:
    return f"{stage} '{topo.stages[stage].name}'"


def _reset_mtp_losses() -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.pop("values", None)


def _mtp_losses(state, microbatches: int, num_mtp: int) -> list[float]:
    """Each MTP layer's loss this step, mean over the micro-batches and the loss stage's
    replicas: megatron-core's MTPLossLoggingHelper keeps the sum of the micro-batches' means
    (its own training loop divides it by their number and averages it over DP, as here)."""
    import torch.distributed as dist
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if not num_mtp:
        return []
    value = MTPLossLoggingHelper.tracker["values"].detach().float().cpu() / microbatches
    dp = state.topology.dp_of(state.stage)
    if dp > 1:  # every replica's loss stage, same (stage, TP rank) group
        dist.all_reduce(value, group=state.dp_group_gloo)
        value /= dp
    return value.tolist()


def _mtp_summary(rows: list, num_mtp: int) -> dict:
    """The run summary's MTP losses: per step, one per MTP layer (``train.verify`` compares
    them); the last step's as ``final_mtp_loss``."""
    if not num_mtp:
        return {}
    per_step = [[r[k] for k in mtp_keys(num_mtp)] for r in rows]
    return {"mtp_losses": per_step, "final_mtp_loss": per_step[-1]}


def _mean_loss(losses, state) -> float:
    import torch.distributed as dist

    value = torch.stack([x["lm loss"].float() for x in losses]).mean().reshape(1).cpu()
    dp = state.topology.dp_of(state.stage)  # per-stage DP: the loss stage's replicas
    if dp > 1:  # every replica's loss stage, same (stage, TP rank) group
        dist.all_reduce(value, group=state.dp_group_gloo)
        value /= dp
    return float(value.item())


def uses_ldt_runtime(train: TrainConfig, topo) -> bool:
    """The U-shape and per-stage DP always run on ldt's runtime; a plain pipeline when
    train.runtime=ldt or train.schedule=zb."""
    from ldt.schedule.size import runs_on_ldt_runtime

    return runs_on_ldt_runtime(topo.u_shape, topo.is_vdp,
                               "ldt" if train.schedule == "zb" else train.runtime)


def reference_config(cfg: dict) -> dict:
    """The single-process reference of ``train.verify``: one stage, TP 1, the same global batch."""
    ref = json.loads(json.dumps(cfg))
    dp = int(cfg["cluster"].get("dp", 1))  # per-stage dp: the largest (docs/vdp.md)
    dp = max([dp] + [int(st["dp"]) for st in cfg["cluster"]["stages"]
                     if st.get("dp") is not None])
    ref["cluster"] = {"stages": [{"name": "reference", "device": "cpu", "tp": 1}],
                      "u_shape": False, "layout": None, "dp": 1}
    ref["train"]["num_microbatches"] = dp * int(cfg["train"]["num_microbatches"])
    ref["train"].update(audit_comm=False, schedule="auto", overlap_p2p_comm=False, prefetch=0)
    ref["reference"] = True
    return ref
