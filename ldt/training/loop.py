"""The training loop of one rank: build its stage, then step.

Flow (one owner per piece): config -> :func:`ldt.topology.validate.validate` (topology) ->
:func:`ldt.groups.parallel_state.initialize_vtp` (groups) -> :mod:`ldt.models.build` + :mod:`ldt.models.init`
(this stage's chunks) -> schedule (megatron's 1F1B / interleaved through the patched
``get_forward_backward_func``, or ldt's U-shape runtime) -> :mod:`ldt.training.optim`
(megatron-core's DDP gradient reduce, ``finalize_model_grads``, optimizer with the global norm
and clipping, lr schedule). Only data stages build a :class:`~ldt.data.bytes.TextData`.
After every step all ranks agree (:mod:`ldt.training.guard`) whether to stop (a signal, a
non-finite loss, a failed save), so they stop together; the reporting rank writes the step's
row (:mod:`ldt.training.outputs`) as it ends. Every phase is marked in this rank's progress
record (:mod:`ldt.launch.progress`), which names the rank a hang waits for.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import ldt.launch.quiet  # noqa: F401  (before megatron-core is imported)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from ldt import patches
from ldt.boundary.communicator import VtpCommunicator
from ldt.boundary.noise import send_transforms
from ldt.config import ConfigError, LdtConfig, TrainConfig
from ldt.config import typed_config
from ldt.data import build_training_data
from ldt.groups.parallel_state import VtpState, destroy_vtp, initialize_vtp
from ldt.launch import progress
from ldt.launch.quiet import set_log_level
from ldt.pipeline.forward_backward import MegatronHooks, run_step
from ldt.schedule.size import runs_on_ldt_runtime
from ldt.schedule.zerobubble import Priced
from ldt.topology.device import rank_device, use_device
from ldt.topology.ranks import Topology
from ldt.topology.validate import validate
from ldt.training import checkpoint, moe, snapshot, snapshot_copies, snapshot_join
from ldt.training.guard import (Decision, Stop, StepGuard, StopSignals, nonfinite_stop,
                                peak_memory_gib, save_failed_stop, signal_stop)
from ldt.training.observe import CommAudit, FiniteCheck
from ldt.training.optim import MIN_LOSS_SCALE, build_stage_optimizer
from ldt.training.outputs import StepOutputs, gather_timings, mtp_keys, write_outputs
from ldt.training.stage import build_stage_models, make_forward_step


def train_worker(rank: int, world: int, cfg: LdtConfig | dict, run_dir: str,
                 resume_verified: bool = False, observe: Optional[Callable] = None,
                 topo: Optional[Topology] = None, priced: Optional[Priced] = None,
                 hold_signals_after_failure: bool = False) -> Optional[dict]:
    """Train on this rank; the loss stage's leader of replica 0 returns the summary (with
    ``stopped``, a :class:`~ldt.training.guard.Stop`, when the run ended early).
    ``cfg``: the launcher's :class:`~ldt.config.LdtConfig` (a plain dict, from tests and the
    API, is typed here once). ``topo``: the topology when this process validated the config
    already (the launchers); else it is validated here, before the first collective.
    ``resume_verified``: the launcher already checked the checkpoint's checksums
    (``train.resume`` / ``train.load``). ``observe(rank, topo, run_dir)`` (module-level) adds
    boundary observers (ldt-audit's). ``priced``: with ``train.schedule=zb``, the plan's prices
    its order is generated from (:func:`ldt.plan.zb_prices.run_prices`), priced once where
    the config was checked and handed to every rank (a cost run's folder is read there only).
    ``hold_signals_after_failure``: a failure leaves the stop signals noted, not restored
    (:class:`~ldt.training.guard.StopSignals`; under torchrun: ``ldt.job.prepare``)."""
    cfg = typed_config(cfg)
    set_log_level(cfg.train.log_level, rank)  # the same under torchrun as in a bare launch
    if topo is None:
        topo = validate(cfg.cluster, cfg.model, world_size=world, train=cfg.train)
    if cfg.train.schedule == "zb" and priced is None:
        raise ConfigError("train.schedule=zb: train_worker needs the run's prices; pass "
                          "priced=ldt.plan.zb_prices.run_prices(cfg.cluster, cfg.model, "
                          "cfg.train), as ldt-train's launchers do")
    _record_pid(run_dir, rank)
    use_device(rank_device(topo, rank))  # before any group or tensor: megatron's current device
    # from here on a stop signal waits for a step boundary
    with StopSignals(hold_after_failure=hold_signals_after_failure) as signals:
        state = initialize_vtp(topo, timeout_s=cfg.train.comm_timeout_s)
        guard = StepGuard(state, signals, StepGuard.world_group(cfg.train.comm_timeout_s))
        observers = _observers(cfg.train, run_dir, rank)
        if observe is not None:
            observers += observe(rank, topo, run_dir)
        names = _patch_names(cfg.train, topo.stages[state.stage].device)
        patches.apply(names, ctx=MegatronHooks(tuple(observers)))
        try:
            return _train(_Run(rank, cfg, topo, state, observers, run_dir, guard,
                               resume_verified, priced, checkpoint.save_group()))
        finally:
            for obs in observers:  # the audit's message tap unwraps torch.distributed
                getattr(obs, "close", lambda: None)()
            patches.revert(names)
            destroy_vtp()


def _patch_names(train: TrainConfig, device: str) -> list[str]:
    """The megatron-core patches this rank's stage trains with (:mod:`ldt.patches`)."""
    cpu = ["cpu_shims", "optimizer_cpu", "rope_cpu"] if device == "cpu" else []
    return cpu + ["schedules", "sequence_parallel_norms", "recompute_norms",
                  "moe_without_te"] + (["wgrad_split"] if train.schedule == "zb" else [])


def _record_pid(run_dir: str, rank: int) -> None:
    """``run_dir/pids/rank_<r>`` holds the rank's process id (which process is rank r?)."""
    folder = os.path.join(run_dir, "pids")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{rank}"), "w") as f:
        f.write(f"{os.getpid()}\n")


def _observers(train: TrainConfig, run_dir: str, rank: int) -> list:
    out: list = []
    if train.audit_comm:
        out.append(CommAudit(os.path.join(run_dir, "comm_audit.jsonl"), rank))
    if train.check_finite if train.check_finite is not None else train.verify:
        out.append(FiniteCheck())
    return out


@dataclass
class _Run:
    """What one rank's run is given, fixed for its life."""

    rank: int
    cfg: LdtConfig
    topo: Topology
    state: VtpState
    observers: list
    run_dir: str
    guard: StepGuard
    resume_verified: bool = False
    priced: Optional[Priced] = None
    """``train.schedule=zb``: the plan's prices its order is generated from."""
    save_group: Any = None
    """Every rank, waiting as long as a save may take (:func:`ldt.training.checkpoint.save_group`)."""

    @property
    def on_loss_stage(self) -> bool:
        return self.state.stage == self.topo.loss_stage()

    @property
    def reporter(self) -> bool:
        """The loss stage's leader of replica 0 writes the outputs and returns the summary."""
        return self.on_loss_stage and self.state.is_leader and self.state.info.dp_rank == 0

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return self.topo.dp * t.num_microbatches * t.micro_batch_size * self.cfg.model.seq_length


@dataclass
class _Stage:
    """This rank's stage, built once: its chunks as the schedule runs them (DDP-wrapped), the
    optimizer, the data (data stages; None elsewhere), the step to start from, and one pass of
    the schedule on the runtime chosen for the run."""

    chunks: list
    models: list
    opt: object
    data: object
    first_step: int
    ldt_runtime: bool
    run_pass: Callable  # (make_iterator, step, forward_only=False) -> (losses, timings)
    snapshots: Optional[snapshot.Snapshots] = None  # train.snapshot_dir


def _build_stage(run: _Run) -> _Stage:
    cfg, topo, state = run.cfg, run.topo, run.state
    progress.current().begin("building the model and optimizer")
    models = build_stage_models(cfg, topo, state)
    chunks = topo.split.stage_chunks(state.stage)
    shared = len({id(p) for g in models for p in g.parameters()}) < \
        sum(1 for g in models for _ in g.parameters())  # U-shape edge: tied embedding + head
    opt = build_stage_optimizer(cfg, topo, state, models, shared_chunks=shared)
    root = snapshot.root_of(cfg.train.snapshot_dir, run.run_dir, topo)
    first_step = _load_checkpoint(run, models, chunks, opt, root)
    data = build_training_data(cfg, topo, state)  # every rank: indexed data builds collectively
    ldt_runtime = runs_on_ldt_runtime(topo.u_shape, topo.is_vdp, cfg.train.runtime,
                                      cfg.train.schedule)
    run_pass = _schedule_pass(run, opt.chunks, data, ldt_runtime)
    snaps = (snapshot.Snapshots(root, state, snapshot_copies.copies(
        topo, cfg.train.distributed_optimizer, cfg.train.comm_timeout_s), first_step)
             if root else None)
    return _Stage(chunks, opt.chunks, opt, data, first_step, ldt_runtime, run_pass, snaps)


def _load_checkpoint(run: _Run, models, chunks, opt, root: Optional[str] = None) -> int:
    """``train.resume`` (weights, optimizer, step) or ``train.load`` (weights only, e.g. an
    imported Hugging Face model: step 0, a fresh optimizer), or a newer snapshot of the run
    in host memory (``root``: :mod:`ldt.training.snapshot`); returns the first step."""
    t = run.cfg.train
    if root and snapshot.continues(t.resume, run.run_dir):
        step = snapshot_join.load_snapshot(root, t, run.run_dir, models, chunks, opt,
                                           run.state, run.cfg.model, run.save_group)
        if step is not None:
            return step
    if not (t.resume or t.load):
        return 0
    progress.current().begin("loading the checkpoint")
    step = checkpoint.load(t.resume or t.load, models, chunks, opt, run.state,
                           verified=run.resume_verified, weights_only=not t.resume,
                           run_dir=run.run_dir)
    return step if t.resume else 0


def _schedule_pass(run: _Run, models: list, data, ldt_runtime: bool) -> Callable:
    """One pass of the schedule over the step's micro-batches -> (the loss stage's losses, the
    actions' timings), on ldt's runtime (one communicator for the run) or megatron's."""
    cfg, state = run.cfg, run.state
    t, m, seq = cfg.train, cfg.train.num_microbatches, cfg.model.seq_length
    forward_step = make_forward_step(seq, rank_device(run.topo, run.rank))
    transforms = send_transforms(t, run.topo, state.stage, state.info.dp_rank)
    if ldt_runtime:
        comm = VtpCommunicator(models[0].config, state, run.observers, transforms)
    else:
        megatron_schedule = get_forward_backward_func()

    def run_pass(make_iterator, step: int, forward_only: bool = False):
        for transform in transforms:  # the noise of this step's pass, wherever the run began
            transform.start(step, evaluation=forward_only)
        iters = [None] * len(models) if data is None else [make_iterator() for _ in models]
        if ldt_runtime:
            res = run_step(forward_step_func=forward_step, data_iterator=iters[0],
                           model=models, num_microbatches=m, seq_length=seq,
                           micro_batch_size=t.micro_batch_size, comm=comm, state=state,
                           config=models[0].config, record_timings=not forward_only,
                           forward_only=forward_only, prefetch=t.prefetch,
                           zero_bubble=t.schedule == "zb", priced=run.priced)
            return res.losses, res.timings
        return megatron_schedule(
            forward_step_func=forward_step, data_iterator=iters if len(models) > 1 else iters[0],
            model=models if len(models) > 1 else models[0], num_microbatches=m,
            seq_length=seq, micro_batch_size=t.micro_batch_size, forward_only=forward_only), []

    return run_pass


def _train(run: _Run) -> Optional[dict]:
    """Build the stage, step until the run ends or the ranks agree to stop, write outputs."""
    stage = _build_stage(run)
    out = (StepOutputs(run.cfg, run.topo, run.run_dir, stage.first_step,
                       moe_aux=moe.tracks_aux_loss(run.cfg.model)) if run.reporter else None)
    rows, timings, stop = [], [], None  # timings: per step, (start, this stage's actions)
    device = run.topo.stages[run.state.stage].device
    for step in range(stage.first_step, run.cfg.train.steps):
        row, timed = _step(run, stage, step)
        progress.current().begin("step boundary", waiting=True)
        decision = run.guard.agree(loss=row["loss"], grad_norm=_checked_norm(row, run.cfg.train),
                                   peak_gib=peak_memory_gib(device),
                                   snapshot_busy=bool(stage.snapshots and stage.snapshots.busy()))
        rows.append(row)
        timings.append(timed)
        if out is not None:
            out.step(row, decision)
        if stage.snapshots is not None and not decision.nonfinite and (
                decision.signum or (step + 1) % run.cfg.train.snapshot_every == 0):
            progress.current().begin("snapshot (copying this rank's state)")
            # at a stop signal this step's snapshot is what the restart starts from: every rank
            # waits for its busy writer rather than skip it (a stop loses no step it can keep)
            stage.snapshots.take(step, stage.opt.models, stage.chunks, stage.opt,
                                 busy=decision.snapshot_busy and not decision.signum)
        stop = _stop_or_save(run, stage, step, row, decision)
        if stop is not None:
            break
    if stage.snapshots is not None:
        progress.current().begin("finishing the last snapshot")
        stage.snapshots.close(finished=stop is None)
    progress.current().begin("writing outputs")
    if out is not None:
        out.close()
    timeline = gather_timings(timings, run.state) if stage.ldt_runtime else None
    if not run.reporter:
        return None
    write_outputs(run.run_dir, rows, timeline, run.topo)
    return _summary(run, stage.first_step, rows, stop)


def _step(run: _Run, stage: _Stage, step: int) -> tuple[dict, tuple]:
    """One training step up to the step boundary: its row of metrics, and its timings."""
    cfg, record = run.cfg, progress.current()
    record.step(step)
    for obs in run.observers:
        obs.new_step(step)
    stage.opt.zero_grad()
    t0 = time.perf_counter()
    record.begin("forward-backward" + ("" if stage.ldt_runtime else " (megatron's schedule)"))
    moe.reset(cfg.model)
    _reset_mtp_losses()  # an evaluation pass (training mode, no graph) adds to them too
    losses, timed = stage.run_pass(lambda: stage.data.step_iterator(step), step)
    record.begin("grad reduce (data-parallel, tied embedding), global norm, optimizer step",
                 waiting=True)
    if stage.snapshots is not None:
        stage.snapshots.copied()  # the last snapshot's copy of the state is made before it changes
    scale = stage.opt.loss_scale()
    lr, norm, applied = stage.opt.step()
    loss, mtp = _step_losses(run, losses)
    dt = time.perf_counter() - t0
    row = dict(step=step, loss=loss, lr=lr, grad_norm=norm, step_time_s=dt,
               tokens_per_s=run.tokens_per_step / dt, eval_loss=None)
    if scale is not None:  # float16: the scale this step used, and whether megatron skipped it
        row.update(loss_scale=scale, skipped=int(not applied))
    if moe.tracks_aux_loss(cfg.model):
        record.begin("MoE load-balancing loss all-reduce", waiting=True)
        row["moe_aux_loss"] = moe.aux_loss(cfg.model, run.topo.dp * cfg.train.num_microbatches,
                                           run.guard.group)
    if loss is not None:
        row.update(zip(mtp_keys(cfg.model.mtp_num_layers), mtp))
    if _evaluates(cfg.train, step):
        row["eval_loss"] = _evaluate(run, stage, step)
    return row, (t0, [(str(a), s - t0, e - t0) for a, s, e in timed])


def _checked_norm(row: dict, t: TrainConfig) -> float:
    """The gradient norm the ranks check for NaN/Inf. A step fp16's dynamic loss scale skipped
    (its gradients overflowed) has none, and that is how the scale finds its level: megatron
    halves it and the run goes on. An overflow at a constant ``train.loss_scale``, or at
    megatron's smallest scale, cannot back off: a non-finite gradient."""
    backs_off = t.loss_scale is None and row.get("loss_scale", 0.0) > MIN_LOSS_SCALE
    return 0.0 if row.get("skipped") and backs_off else row["grad_norm"]


def _evaluates(t: TrainConfig, step: int) -> bool:
    return bool(t.eval_every) and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps)


def _evaluate(run: _Run, stage: _Stage, step: int) -> Optional[float]:
    """The held-out loss (the loss stage's; None elsewhere), as megatron's evaluate(): no
    graph, no gradients."""
    progress.current().begin("evaluation")
    with torch.no_grad():
        losses, _ = stage.run_pass(stage.data.eval_iterator if stage.data else None, step, True)
    return _mean_loss(losses, run.state) if run.on_loss_stage else None


def _stop_or_save(run: _Run, stage: _Stage, step: int, row: dict,
                  decision: Decision) -> Optional[Stop]:
    """After the ranks agreed at a step boundary: why the run stops now (a non-finite loss,
    a failed save, a stop signal after its checkpoint), or None to go on."""
    t, run_dir = run.cfg.train, run.run_dir
    if decision.nonfinite and t.stop_on_nonfinite:
        where = _stage_name(run.topo, run.topo.loss_stage())
        return nonfinite_stop(decision, step, row["loss"], row["grad_norm"], where,
                              checkpoint.latest(run_dir))
    saved = None
    # the last step too (as megatron's pretrain): the run's end is never trained again, and
    # ldt-convert export RUN exports it
    if t.save_every and ((step + 1) % t.save_every == 0 or step + 1 == t.steps
                         or decision.signum):
        # a writer works (its disk), the others wait for it: the launcher blames a stall so
        progress.current().begin("saving a checkpoint",
                                 waiting=not checkpoint.writes(run.state))
        result = checkpoint.save(run_dir, step, stage.opt.models, stage.chunks, stage.opt,
                                 run.state, info={"steps": t.steps,
                                                  "optimizer": t.optimizer.name,
                                                  "run_state": stage.opt.run_state()},
                                 model=run.cfg.model,
                                 keep_last=t.keep_last, group=run.save_group,
                                 origin=t.resume or t.load)
        if result.error:
            return save_failed_stop(result.error, step, checkpoint.latest(run_dir), run_dir)
        saved = result.path
    if decision.signum:
        return signal_stop(decision.signum, step, saved, t.save_every,
                           checkpoint.latest(run_dir), run_dir)
    return None


def _summary(run: _Run, first_step: int, rows: list, stop: Optional[Stop]) -> dict:
    """The reporting rank's run summary (the last line ``ldt-train`` prints)."""
    t, num_mtp = run.cfg.train, run.cfg.model.mtp_num_layers
    head = {"steps": t.steps, "first_step": first_step}
    tail = {"run_dir": run.run_dir, **({"stopped": stop} if stop is not None else {})}
    if not rows:
        return {**head, "losses": [], **tail}
    steady = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]
    step_time = sorted(steady)[len(steady) // 2]
    evals = [r["eval_loss"] for r in rows if r["eval_loss"] is not None]
    aux = [r["moe_aux_loss"] for r in rows if r.get("moe_aux_loss") is not None]
    return {**head, "final_loss": rows[-1]["loss"], "first_loss": rows[0]["loss"],
            "losses": [r["loss"] for r in rows], **_mtp_summary(rows, num_mtp),
            "tokens_per_s": run.tokens_per_step / step_time, "step_time_s": step_time,
            **({"eval_loss": evals[-1], "eval_losses": evals} if evals else {}),
            **({"moe_aux_loss": aux[-1], "moe_aux_losses": aux} if aux else {}), **tail}


def _stage_name(topo, stage: int) -> str:
    return f"{stage} '{topo.stages[stage].name}'"


def _reset_mtp_losses() -> None:
    MTPLossLoggingHelper.tracker.pop("values", None)


def _step_losses(run: _Run, losses: list) -> tuple[Optional[float], list[float]]:
    """The step's loss and each MTP layer's, means over the micro-batches and the loss
    stage's replicas, in one all-reduce; ``(None, [])`` off the loss stage. megatron-core's
    MTPLossLoggingHelper keeps the sum of the micro-batches' MTP means (its own training loop
    divides it by their number and averages it over DP, as here)."""
    if not run.on_loss_stage:
        return None, []
    progress.current().begin("loss all-reduce", waiting=True)
    values = [_microbatch_mean(losses)]
    if run.cfg.model.mtp_num_layers:
        values.append(MTPLossLoggingHelper.tracker["values"].detach().float().cpu()
                      / len(losses))
    means = _replica_mean(torch.cat(values), run.state).tolist()
    return means[0], means[1:]


def _mtp_summary(rows: list, num_mtp: int) -> dict:
    """The run summary's MTP losses: per step, one per MTP layer (``train.verify`` compares
    them); the last step's as ``final_mtp_loss``."""
    if not num_mtp:
        return {}
    per_step = [[r[k] for k in mtp_keys(num_mtp)] for r in rows]
    return {"mtp_losses": per_step, "final_mtp_loss": per_step[-1]}


def _mean_loss(losses: list, state) -> float:
    """The loss of a pass: mean over its micro-batches and the loss stage's replicas."""
    return float(_replica_mean(_microbatch_mean(losses), state).item())


def _microbatch_mean(losses: list) -> torch.Tensor:
    return torch.stack([x["lm loss"].float() for x in losses]).mean().reshape(1).cpu()


def _replica_mean(value: torch.Tensor, state) -> torch.Tensor:
    """``value`` averaged over the loss stage's replicas (per-stage DP: its own dp), in place:
    every replica's loss stage, same (stage, TP rank) group."""
    dp = state.topology.dp_of(state.stage)
    if dp > 1:
        dist.all_reduce(value, group=state.dp_group_gloo)
        value /= dp
    return value

