"""The optimizer of one stage: megatron-core's DDP, optimizer and lr schedule over VTP stages.

Each stage's chunks are wrapped as a Megatron training script wraps them: ``Float16Module``
(bf16/fp16), then megatron-core's ``DistributedDataParallel`` with the stage's own
data-parallel group (VTP: the DP group of (stage, TP rank) across replicas); the optimizer is
``get_megatron_optimizer`` (Adam or SGD, fp32 main params, fp16 loss scaling, the distributed
optimizer) and the learning rate megatron's ``OptimizerParamScheduler`` (linear warmup, cosine
decay to ``min_lr``). Every group comes from ``state.pg_collection()``. After the backward pass
megatron's ``finalize_model_grads`` reduces the DP gradients and sums a tied embedding's two
copies over ldt's embedding group (which reshards between the two stages' TP sizes).

The only piece megatron-core cannot do itself is the cross-stage part of the global gradient
norm (and of fp16's found-inf flag). Megatron reduces the squared norm over one group:
``pg.mp`` (``pg.intra_dist_opt`` with the distributed optimizer), filtering TP duplicates
through the local ``pg.tp``, which is right for stages of different TP sizes. But with VTP that
group spans stages that may run different device types and backends (an NCCL and an HCCL stage
cannot share a native group). So that group is ldt's
:class:`~ldt.groups.cross_stage.StageHierarchyGroup`: a stage-local leg on the stage's own group plus
one host-staged leg between the stage leaders over gloo. That group is the seam; the rest of
megatron's optimizer, clipping included, runs untouched.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ldt.models.build import DTYPES
from ldt.schedule.routing import grad_factor


@dataclass
class StageOptimizer:
    """What the training loop of one rank steps.

    ``chunks``: what the schedule runs (one per model chunk, in order); ``ddp``: the DDP
    modules holding the gradient buffers (one per chunk, or one for the whole stage when two
    chunks share a parameter: the U-shape edge's tied embedding and head); ``models``: the
    bare GPT chunks (names, checkpoints)."""

    chunks: list
    ddp: list
    models: list
    optimizer: object
    scheduler: object
    pg_collection: object
    grad_factor: float = 1.0  # per-stage DP: ldt.schedule.routing.grad_factor (1 otherwise)

    def zero_grad(self) -> None:
        for d in self.ddp:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def loss_scale(self) -> Optional[float]:
        """fp16's loss scale now (megatron's grad scaler); None without one (bf16, fp32)."""
        scaler = getattr(_inner(self.optimizer), "grad_scaler", None)
        return None if scaler is None else float(scaler.scale)

    def run_state(self) -> dict:
        """What a resume needs beside the tensors, the same on every rank: the lr schedule's
        steps (``lr_steps``: a step fp16 skipped did not advance it) and fp16's dynamic loss
        scale (megatron's grad scaler: ``loss_scale``, ``growth_tracker``,
        ``hysteresis_tracker``). Plain numbers: ``checkpoint.json`` holds them."""
        out = {"lr_steps": int(self.scheduler.num_steps)}
        scalers = _dynamic_scalers(self.optimizer)
        if scalers:  # chained optimizers step together: the first one's state is theirs
            saved = scalers[0].state_dict()
            out.update(loss_scale=float(saved["scale"]),
                       growth_tracker=int(saved["growth_tracker"]),
                       hysteresis_tracker=int(saved["hysteresis_tracker"]))
        return out

    def resume_at(self, step: int, saved: Optional[dict] = None) -> None:
        """Put the lr schedule and fp16's loss scale where the run stood before step ``step``
        (a resume). ``saved``: :meth:`run_state` when that step's predecessor was saved; a
        checkpoint written before ldt recorded it puts the schedule at the step number."""
        saved = saved or {}
        lr_steps = int(saved.get("lr_steps", step + 1))  # built at 1: the first step's lr
        if lr_steps > 1:
            self.scheduler.step(increment=lr_steps - 1)
        if not set(LOSS_SCALE_KEYS) <= saved.keys():
            return
        for scaler in _dynamic_scalers(self.optimizer):
            scaler.load_state_dict({
                "scale": torch.tensor([saved["loss_scale"]], dtype=torch.float),
                "growth_tracker": int(saved["growth_tracker"]),
                "hysteresis_tracker": int(saved["hysteresis_tracker"])})

    def step(self) -> tuple[float, float, bool]:
        """Reduce the gradients (DP, tied embedding), clip, step; -> (lr used, global grad
        norm, whether the update was applied: fp16 skips a step with inf/nan gradients)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(self.ddp, pg_collection=self.pg_collection)
        if self.grad_factor != 1.0:  # per-stage DP: the uniform-DP gradient (routing.py)
            for d in self.ddp:
                d.scale_gradients(self.grad_factor)
        lr = self.lr()
        applied, norm, _ = self.optimizer.step()
        if applied:
            self.scheduler.step(increment=1)
        return lr, float(norm) if norm is not None else float("nan"), bool(applied)


@functools.cache
def _float16_module():
    from megatron.core.transformer.module import Float16Module

    class StageFloat16Module(Float16Module):
        """megatron's Float16Module, upcasting the output to fp32 only on a chunk with the
        head. Megatron upcasts on the last pipeline stage, which in a U-shape is a cloud
        stage that sends its 16-bit activations on to the edge (fp32 there would not match
        the edge's 16-bit receive buffer: gloo's "32768 vs 16384" size mismatch)."""

        def forward(self, *inputs, fp32_output=True, **kwargs):
            head = getattr(self.module, "post_process", True)
            return super().forward(*inputs, fp32_output=fp32_output and head, **kwargs)

    return StageFloat16Module


def main_params_in_fp32(model, train) -> bool:
    """``train.fp32_main_params`` with its default: true for bf16/fp16 (fp32 has no copy)."""
    if model.params_dtype == "float32":
        return False
    return True if train.fp32_main_params is None else bool(train.fp32_main_params)


LOSS_SCALE_KEYS = ("loss_scale", "growth_tracker", "hysteresis_tracker")
"""fp16's dynamic loss scale in :meth:`StageOptimizer.run_state` (absent with any other
scale)."""
RUN_STATE_KEYS = ("lr_steps", *LOSS_SCALE_KEYS)
"""What :meth:`StageOptimizer.run_state` may hold."""

MIN_LOSS_SCALE = 1.0
"""fp16's smallest dynamic loss scale (megatron's ``OptimizerConfig.min_loss_scale``, its
default), given to megatron here so that :mod:`ldt.training.loop` knows it."""


def optimizer_config(c):
    """megatron-core's OptimizerConfig from ``train.*`` and the model's dtype."""
    from megatron.core.optimizer import OptimizerConfig

    t, dtype = c.train, DTYPES[c.model.params_dtype]
    fp32_main = main_params_in_fp32(c.model, t)
    return OptimizerConfig(
        optimizer=t.optimizer.name, lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.optimizer.adam_beta1, adam_beta2=t.optimizer.adam_beta2,
        adam_eps=t.optimizer.adam_eps, sgd_momentum=t.optimizer.sgd_momentum,
        clip_grad=t.clip_grad, params_dtype=dtype,
        bf16=fp32_main and dtype == torch.bfloat16, fp16=dtype == torch.float16,
        loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale or 2.0 ** 16,
        min_loss_scale=MIN_LOSS_SCALE,
        use_distributed_optimizer=t.distributed_optimizer)


def build_stage_optimizer(c, topo, state, models: list, shared_chunks: bool) -> StageOptimizer:
    """Wrap this stage's ``models`` and build megatron-core's optimizer for them.
    ``shared_chunks``: two chunks hold the same parameter (one DDP for the stage)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t, dtype = c.train, DTYPES[c.model.params_dtype]
    fp32_main = main_params_in_fp32(c.model, t)
    pgs = state.pg_collection()
    chunks = [_float16_module()(m.config, m) if dtype != torch.float32 else m for m in models]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp32_main or dtype == torch.float32,
        overlap_grad_reduce=t.overlap_grad_reduce,
        use_distributed_optimizer=t.distributed_optimizer,
        bucket_size=t.ddp_bucket_size,
        average_in_collective=False)

    def wrap(module, config):
        return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                       pg_collection=pgs)

    if shared_chunks:  # one buffer, each shared parameter once
        ddp = [wrap(torch.nn.ModuleList(chunks), models[0].config)]
        run = chunks
        no_sync = ddp[0].no_sync
    else:
        ddp = run = [wrap(ch, m.config) for ch, m in zip(chunks, models)]
        no_sync = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync
    opt_config = optimizer_config(c)
    optimizer = get_megatron_optimizer(opt_config, ddp, use_gloo_process_groups=False,
                                       pg_collection=pgs)
    factor = 1.0
    if topo.is_vdp:
        factor = grad_factor(topo.dp_of(state.stage), topo.dp_of(topo.loss_stage()))
        if not t.distributed_optimizer:
            # pg.mp is one replica's ranks, but per-stage DP has no replica that spans the
            # stages evenly: the statistics go over every rank, each stage counted once
            # (the distributed optimizer's pg.intra_dist_opt already sums each shard once)
            for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:
                opt.grad_stats_parallel_group = state.grad_stats_group
    for m in models:  # what megatron's training loop sets on the model config
        m.config.grad_scale_func = optimizer.scale_loss
        m.config.no_sync_func = no_sync if t.overlap_grad_reduce else None
        m.config.finalize_model_grads_func = None  # the step calls it (every runtime alike)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps, lr_decay_steps=max(t.steps, t.warmup_steps + 1),
        lr_decay_style="cosine", start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=t.steps, wd_incr_style="constant")
    # Step k trains at the schedule's value after k + 1 increments: warmup ramps lr/warmup,
    # 2 lr/warmup, ..., so the first step is not spent at lr 0.
    scheduler.step(increment=1)
    return StageOptimizer(chunks=run, ddp=ddp, models=models, optimizer=optimizer,
                          scheduler=scheduler, pg_collection=pgs, grad_factor=factor)


# ---- optimizer state as full (TP-local) tensors per parameter: checkpoints ----------------
def _dynamic_scalers(optimizer) -> list:
    """fp16's dynamic grad scalers, one per chained optimizer (a constant scale has no state,
    bf16 and fp32 no scaler): the one rule for what :meth:`StageOptimizer.run_state` saves and
    :meth:`StageOptimizer.resume_at` restores."""
    scalers = (getattr(opt, "grad_scaler", None)
               for opt in getattr(optimizer, "chained_optimizers", [optimizer]))
    return [s for s in scalers if s is not None and s.state_dict()]


def _inner(optimizer, param=None):
    """The megatron optimizer stepping ``param`` (None: the first; all share one config).
    megatron chains a second optimizer for the experts of an expert-parallel stage (ep > 1);
    a parameter no optimizer holds on this rank (the distributed optimizer keeps none of its
    elements here) goes with the first."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return optimizer
    if param is not None:
        for opt in chained[1:]:
            if _holds(opt, param):
                return opt
    return chained[0]


def _holds(opt, param) -> bool:
    """Whether megatron optimizer ``opt`` steps model parameter ``param`` on this rank."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(opt, DistributedOptimizer):
        return param in opt.model_param_gbuf_map
    main = getattr(param, "main_param", None)
    target = param if main is None else main
    return any(p is target for group in opt.optimizer.param_groups for p in group["params"])


def _locate(opt, param):
    """(main tensor or None, its optimizer state dict, (start, end) in the param's flat
    elements or None for the whole param) of ``param`` on this rank."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(opt, DistributedOptimizer):
        if param not in opt.model_param_gbuf_map:  # no element of it is this rank's
            return None, {}, (0, 0)
        rng = opt._get_model_param_range_map(param)["param"]
        if param not in opt.model_param_group_index_map:
            return None, {}, (rng.start, rng.end)
        gi, go = opt.model_param_group_index_map[param]
        main = opt.optimizer.param_groups[gi]["params"][go]
        return main, opt.optimizer.state.setdefault(main, {}), (rng.start, rng.end)
    main = getattr(param, "main_param", None)
    main = param if main is None else main
    return main, opt.optimizer.state.setdefault(main, {}), None


ADAM_KEYS, SGD_KEYS = ("exp_avg", "exp_avg_sq"), ("momentum_buffer",)
PARAM_STATE_KINDS = ("main_param", *ADAM_KEYS, *SGD_KEYS, "step")  # any optimizer's, per param


def state_keys(stage_opt: StageOptimizer) -> tuple[str, ...]:
    """The per-parameter tensors of this optimizer kind (besides the main param)."""
    return ADAM_KEYS if _inner(stage_opt.optimizer).config.optimizer == "adam" else SGD_KEYS


def has_main_params(stage_opt: StageOptimizer) -> bool:
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return not isinstance(_inner(stage_opt.optimizer), FP32Optimizer)


def _step_holder(opt, main, st: dict) -> dict:
    """The dict whose ``"step"`` is Adam's step count for ``main`` (megatron optimizer
    ``opt``, ``main``'s optimizer state ``st``): ``st`` itself with torch's Adam/AdamW (the
    ``Adam`` megatron-core picks without Transformer Engine or apex), which count per
    parameter; else ``main``'s param group: Transformer Engine's and apex's FusedAdam count
    once per group (``group["step"]``, a Python int) and keep no step per parameter. Read
    from ``st`` alone, a fused Adam's step would be saved as 0 and a resume would restart
    bias correction on top of restored moments. {} when this rank keeps none of ``main``."""
    if main is None:
        return {}
    if "step" in st or isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return st
    return next((g for g in opt.optimizer.param_groups if any(p is main for p in g["params"])),
                st)


def param_state(stage_opt: StageOptimizer, param, dp_group) -> Optional[dict]:
    """This TP rank's full tensors (``main_param`` when the optimizer keeps one, and the
    optimizer's moments, fp32) and ``step`` of ``param``, gathered over the data-parallel
    ranks when the distributed optimizer shards them; None before the first step."""
    opt = _inner(stage_opt.optimizer, param)
    main, st, span = _locate(opt, param)
    keys = state_keys(stage_opt)
    names = (("main_param",) if has_main_params(stage_opt) else ()) + keys
    step = _step_holder(opt, main, st).get("step", 0)
    present = torch.tensor([1.0 if keys[0] in st else 0.0, float(step)], dtype=torch.float64)
    if span is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=dp_group)
    if not present[0]:
        return None
    out = {}
    for name in names:
        local = main if name == "main_param" else st.get(name)
        if span is None:
            out[name] = local.detach().float().view(param.shape).clone()
            continue
        flat = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if local is not None:
            flat[span[0]:span[1]] = local.detach().float().view(-1)
        dist.all_reduce(flat, group=dp_group)  # each element is owned by one DP rank
        out[name] = flat.view(param.shape)
    out["step"] = torch.tensor(present[1].item())
    return out


def load_param_state(stage_opt: StageOptimizer, param, tensors: dict) -> None:
    """Set ``param``'s main copy and optimizer state from this TP rank's full tensors
    (``main_param`` optional: absent, the main copy is the loaded weight)."""
    opt = _inner(stage_opt.optimizer, param)
    main, st, span = _locate(opt, param)
    if main is None:
        return  # the distributed optimizer keeps no shard of it on this rank

    def local(t):
        t = t.to(device=main.device, dtype=torch.float32)
        return t.reshape(-1)[span[0]:span[1]].clone() if span is not None else \
            t.reshape(main.shape).clone()

    with torch.no_grad():
        if "main_param" in tensors and main is not param:
            main.copy_(local(tensors["main_param"]).view(main.shape))
        for k in state_keys(stage_opt):
            if k in tensors:
                st[k] = local(tensors[k]).to(main.dtype).view(main.shape)
        if "step" in tensors and "exp_avg" in st:
            holder = _step_holder(opt, main, st)
            holder["step"] = (torch.as_tensor(float(tensors["step"])) if holder is st
                              else int(tensors["step"]))  # a group's: a fused Adam's int


def local_param_state(stage_opt: StageOptimizer, param) -> dict:
    """``param``'s optimizer tensors as this rank keeps them, not copied and with no
    collective: ``main_param`` when the optimizer keeps a separate one, its moments and
    ``step``; with the distributed optimizer only this rank's flat span ({} when it keeps none
    of it). For a snapshot that the same rank of the same layout loads back
    (:func:`set_local_param_state`)."""
    opt = _inner(stage_opt.optimizer, param)
    main, st, _ = _locate(opt, param)
    if main is None:
        return {}
    out = {k: st[k] for k in state_keys(stage_opt) if k in st}
    if main is not param:
        out["main_param"] = main
    holder = _step_holder(opt, main, st)
    if "step" in holder:
        out["step"] = torch.as_tensor(holder["step"])
    return out


def local_span(stage_opt: StageOptimizer, param) -> Optional[tuple[int, int]]:
    """Which flat elements of ``param`` (its TP shard) this rank's :func:`local_param_state`
    holds: ``(start, end)`` with the distributed optimizer, None for the whole parameter."""
    return _locate(_inner(stage_opt.optimizer, param), param)[2]


def set_local_param_state(stage_opt: StageOptimizer, param, tensors: dict) -> None:
    """Put back what :func:`local_param_state` gave on this rank of the same layout."""
    opt = _inner(stage_opt.optimizer, param)
    main, st, _ = _locate(opt, param)
    if main is None:
        return
    with torch.no_grad():
        if "main_param" in tensors and main is not param:
            main.copy_(tensors["main_param"])
        for k in state_keys(stage_opt):
            if k in tensors:
                st[k] = tensors[k].to(device=main.device, copy=True)
        if "step" in tensors:
            holder = _step_holder(opt, main, st)
            holder["step"] = tensors["step"].clone() if holder is st else int(tensors["step"])


def reload_main_params(stage_opt: StageOptimizer) -> None:
    """Copy the (just loaded) model weights into the fp32 main params."""
    if has_main_params(stage_opt):
        stage_opt.optimizer.reload_model_params()
