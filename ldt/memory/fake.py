"""One rank of a real-size world, in one process, without memory: fake tensors and a fake
process group.

torch's ``FakeTensorMode`` gives every tensor its shape, dtype and storage size but no data,
and torch's fake process group (``torch.testing._internal.distributed.fake_pg``, the one
torchtitan's memory estimator uses) accepts every collective and does nothing. Inside
:func:`fake_rank` this process is rank ``r`` of a world of ``world_size``: ldt builds its
groups, its chunks and megatron-core's optimizer exactly as on the real machine, and
megatron-core's own code runs a forward and backward on them, at full size, on a CPU, in
seconds. What it takes, beyond torch's two tools (each measured with megatron-core 0.16.1 and
torch 2.13 here):

- ``new_group(ranks, backend=...)``: ldt asks for gloo / the device's backend by name; in a
  fake world every group is the fake backend's (the backend argument is dropped);
- ``all_gather_object``: megatron's optimizer aligns its parameter groups over the world with
  it, which needs real values; every rank of a stage builds the same groups, so each slot gets
  this rank's own object;
- the ``fake_tensors`` patch (megatron's RNG tracker checks a value in ``fork``) and the CPU
  shims (megatron allocates some buffers on ``cuda``);
- ``Module._apply`` cannot swap fake parameters ("Cannot swap t1 because it has weakref"):
  the chunks are built in their training dtype already, so Float16Module's cast is the
  identity, and the caller lets the chunks answer ``.bfloat16()`` / ``.half()`` with themselves.

A MoE model needs one more stand-in. megatron's token dispatch asks for shapes that only the
routing knows: which tokens each expert gets (``masked_select`` over the routing map), how
many (``tokens_per_expert.tolist()``) and, from megatron-core 0.17, how many in all
(``tokens_per_expert.sum().item()``, before any selection), and fake tensors hold no routing.
:class:`BalancedRouting` answers them as if the router spread the tokens evenly,
``tokens * topk / experts`` per expert: what the load-balancing loss drives toward, and the
expected load of an expert. A skewed
routing puts more on the busiest expert's rank than the estimate says.

Call it in a process of its own (``ldt.memory.estimate`` starts one): it replaces
``torch.distributed``'s default group and two of its functions until it exits.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ldt import patches
from ldt.patches.registry import swap_attr

PATCHES = ["cpu_shims", "optimizer_cpu", "rope_cpu", "sequence_parallel_norms",
           "recompute_norms", "moe_without_te", "fake_tensors"]


class BalancedRouting(TorchDispatchMode):
    """Under fake tensors, megatron's MoE dispatch as if every expert got ``topk / experts`` of
    the tokens (see the module docstring). The dispatcher counts each expert's tokens as
    ``routing_map.sum(dim=0)`` over the boolean map ``[tokens, experts here]``: from its
    token count this mode knows the even share, and answers the data-dependent questions
    after it: a ``masked_select`` (the selection of tokens and of their routing weights by the
    map ``[experts here, tokens]``) with that many elements, an integer ``item`` of the counts'
    sum with the total, and any other integer ``item`` (``tokens_per_expert.tolist()``, one
    expert at a time) with the share. Everything else, and an integer ``item`` before any
    count, goes on to the fake mode as it is."""

    def __init__(self, topk: int, experts: int) -> None:
        super().__init__()
        self.topk, self.experts = topk, experts
        self.per_expert: Optional[int] = None
        self._total: Optional[tuple[weakref.ref, int]] = None  # (the counts' sum, its value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten  # every operation of the estimate comes through here
        if func is aten.masked_select.default:
            values, routing = args
            selected = routing.numel() * self.topk // self.experts
            self.per_expert = selected // routing.shape[0]
            return values.new_empty((selected,))
        if func is aten._local_scalar_dense.default and self.per_expert is not None \
                and not args[0].is_floating_point():
            total = self._total
            return total[1] if total is not None and total[0]() is args[0] else self.per_expert
        out = func(*args, **(kwargs or {}))
        if func is aten.sum.dim_IntList and args[0].dtype == torch.bool and args[0].dim() == 2 \
                and list(args[1]) == [0]:  # tokens_per_expert = routing_map.sum(dim=0)
            self.per_expert = args[0].shape[0] * self.topk // self.experts
        elif func is aten.sum.default and self.per_expert is not None and args[0].dim() == 1 \
                and not args[0].is_floating_point():  # tokens_per_expert.sum()
            self._total = (weakref.ref(out), self.per_expert * args[0].numel())
        return out


@contextlib.contextmanager
def fake_rank(world_size: int, rank: int,
              experts: Optional[tuple[int, int]] = None) -> Iterator[object]:
    """This process as ``rank`` of a fake world; yields the FakeTensorMode to build under.
    ``experts``: a MoE model's ``(topk, experts)``, routed evenly (:class:`BalancedRouting`)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    new_group = dist.new_group

    def fake_group(*args, backend=None, **kwargs):
        return new_group(*args, **kwargs)

    def own_object(out: list, obj, group=None) -> None:
        out[:] = [obj] * len(out)

    undo = [swap_attr(dist, "new_group", fake_group),
            swap_attr(dist, "all_gather_object", own_object)]
    applied = patches.apply(PATCHES)
    try:
        with contextlib.ExitStack() as stack:
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            if experts is not None:
                stack.enter_context(BalancedRouting(*experts))
            yield mode
    finally:
        patches.revert(applied)
        for u in reversed(undo):
            u()
        dist.destroy_process_group()
