"""Stand-ins for megatron's gradient reductions in test worlds and benches that run the
schedules on bare chunks (no ``DistributedDataParallel``) and compare raw ``.grad`` with a
single-process reference. Training (:mod:`ldt.training.optim`) uses megatron's DDP and
``finalize_model_grads``, which do both of these.

* :func:`allreduce_sequence_parallel_grads`: with sequence parallelism each TP rank runs the
  norms (and adds the row-parallel biases) on its slice of the sequence, so those gradients are
  partial sums; megatron marks them ``sequence_parallel=True`` (the norms through
  :mod:`ldt.patches.sequence_parallel`, as Transformer Engine's) and sums them over TP
  (``_allreduce_non_tensor_model_parallel_grads``).
* :func:`average_dp_grads`: the data-parallel average over the stage's replicas, then per-stage
  DP's :func:`ldt.schedule.routing.grad_factor` (``StageOptimizer.step`` applies it after
  ``finalize_model_grads``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ldt.schedule.routing import grad_factor


def allreduce_sequence_parallel_grads(models, tp_group) -> None:
    """Sum the gradients of the parameters marked ``sequence_parallel`` over ``tp_group``
    (one coalesced all-reduce, as megatron does); nothing to do without them or at TP 1."""
    if tp_group is None or tp_group.size() < 2:
        return
    params = {id(p): p for gpt in models for p in gpt.parameters()
              if getattr(p, "sequence_parallel", False) and p.grad is not None}
    grads = [p.grad.data for p in params.values()]
    if not grads:
        return
    coalesced = _flatten_dense_tensors(grads)
    dist.all_reduce(coalesced, group=tp_group)
    for buf, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
        buf.copy_(synced)


def average_dp_grads(params, state) -> None:
    """Average ``.grad`` over the stage's data-parallel replicas, then scale by per-stage DP's
    gradient factor (1 with uniform DP): what DDP + ``StageOptimizer.step`` do to main grads."""
    topo = state.topology
    dp = topo.dp_of(state.stage)
    factor = grad_factor(dp, topo.dp_of(topo.loss_stage())) / dp
    grads = [p.grad for p in params if p.grad is not None]
    coalesced = _flatten_dense_tensors(grads)
    if dp > 1:
        dist.all_reduce(coalesced, group=state.dp_group)
    coalesced *= factor
    for buf, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
        buf.copy_(synced)
