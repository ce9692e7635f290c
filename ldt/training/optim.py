"""Optimizer step pieces that must know the VTP layout: DP gradient all-reduce and the
global gradient norm across stages whose TP sizes differ.

Norm rule: a parameter megatron marks ``tensor_model_parallel`` is sharded, so its squares
are summed over the stage's TP group; a replicated one (norms, row-parallel biases, position
embeddings) is counted once, not TP-size times. Stage totals are then summed over the stage
leaders (gloo, since stages may sit on different device types) and broadcast in each stage.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ldt.vdp_transport import counts_in_norm


def allreduce_dp_grads(params: list[torch.nn.Parameter], state) -> None:
    """Average gradients over data-parallel replicas (one flat all-reduce); with per-stage DP
    then scaled by :func:`ldt.schedule.routing.grad_factor` (the uniform-DP gradient)."""
    from ldt.schedule.routing import grad_factor

    topo = state.topology
    dp = topo.dp_of(state.stage)
    factor = grad_factor(dp, topo.dp_of(topo.loss_stage()))
    if dp == 1 and factor == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    if dp > 1:
        dist.all_reduce(flat, group=state.dp_group)
    if factor == 1:
        flat /= dp
    else:
        flat *= factor / dp
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def allreduce_tied_grads(models, state) -> None:
    """Sum the gradients of a tied embedding and head that sit on different stages, over
    megatron's embedding group (ldt's: it reshards between the two stages' TP sizes)."""
    if state.embd_group is None or state.embd_group.size() < 2:
        return
    for gpt in models:
        if getattr(gpt, "share_embeddings_and_output_weights", False):
            weight = gpt.shared_embedding_or_output_weight()
            if weight is not None and weight.grad is not None:
                dist.all_reduce(weight.grad, group=state.embd_group)


def global_grad_norm(params: list[torch.nn.Parameter], state) -> float:
    """The L2 norm of the whole model's gradient, each parameter counted once (a tied
    head's copy of the embedding, marked ``shared``, is skipped)."""
    device = params[0].device if params else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or getattr(p, "shared", False):
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    tp = len(state.stage_ranks)
    if tp > 1:
        dist.all_reduce(sharded, group=state.tp_group)
    stage_sq = (sharded + replicated).reshape(1)
    if not counts_in_norm(state):  # per-stage DP: one group of every replica's leaders
        stage_sq.zero_()
    if state.topology.num_stages > 1:
        total = stage_sq.cpu()
        if state.is_leader:
            dist.all_reduce(total, group=state.leader_group)
        total = total.to(device)
        if tp > 1:
            dist.broadcast(total, src=state.stage_ranks[0], group=state.tp_group)
        stage_sq = total
    return math.sqrt(float(stage_sq.item()))


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, norm: float) -> None:
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def lr_lambda(warmup: int, total: int, lr: float, min_lr: float):
    """Linear warmup, then cosine decay to min_lr (as a factor of lr, for LambdaLR)."""
    floor = min_lr / lr if lr > 0 else 0.0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
