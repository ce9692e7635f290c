"""The one gradient reduction sequence parallelism adds: partial grads summed over TP.

With sequence parallelism each TP rank of a stage runs the norms (and adds the row-parallel
linear biases) on its slice of the sequence only, so those parameters' gradients are partial
sums: megatron marks them ``sequence_parallel=True`` (``RowParallelLinear``; the norms through
:mod:`ldt.patches.sequence_parallel`, as Transformer Engine's do) and sums them over the TP
group in ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``). ldt's loop
calls this function until megatron's DDP and ``finalize_model_grads`` are in (issue #14);
then megatron's call does it and this one goes.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


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
