"""Process groups that span stages, for megatron-core code that takes one from parallel_state.

Megatron-core runs collectives on groups that, in a VTP world, cross stages: the pipeline group
(``finalize_model_grads`` broadcasts the token count over it), the embedding group (tied input
embedding and output layer on the first and last stage), the model-parallel group (gradient
norm, found-inf) and the distributed-optimizer instance group. No native group can do that
here: NCCL and HCCL ranks cannot share one, and the embedding shards do not even line up (each
stage splits the vocabulary by its own TP size). So these groups are ``torch.distributed``
process groups written in Python. Each collective is a stage-local leg on the stage's own
native group plus one cross-stage leg between the stage leaders over gloo with the tensor
copied to the host and back: the channel the boundary transport already uses.

Three kinds, by what one member of the group stands for:

- :class:`StagePipelineGroup`: one member per stage (pipeline, position embedding). Values are
  replicated inside a stage, so the leaders do the collective and broadcast in their stage.
- :class:`EmbeddingGroup`: one member per stage holding a vocabulary-parallel shard. The
  leaders gather their stage's shards to the full tensor, reduce it across stages and scatter
  the result back by their own stage's TP split (the reshard between TP sizes).
- :class:`StageHierarchyGroup`: every rank of the member stages is a member (model parallel,
  distributed-optimizer instance). Reductions first run over the stage-local group.

Each group is registered with ``torch.distributed`` under the member list *this* rank sees
(:func:`register`), so ``get_rank``, ``get_process_group_ranks`` and ``src=`` global ranks
work. For one-member-per-stage groups that list is the leader of every other stage and the
rank itself for its own stage: only leaders cross stages.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.futures import Future


class _Done(dist._Work):
    """The work of a collective that already completed (these groups run synchronously)."""

    def __init__(self, result=None):
        super().__init__()
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self._result)
        return fut


def _op(opts) -> ReduceOp:
    op = getattr(opts, "reduceOp", ReduceOp.SUM)
    return getattr(op, "op", op)  # AllreduceOptions wraps it in a ReduceOp object


class CrossStageGroup(dist.ProcessGroup):
    """Common part: the leaders' host-staged leg and the stage broadcast.

    ``stage_group`` is the native group of this rank's stage (its TP group, or TP x DP),
    ``stage_root`` the global rank that represents the stage across stages (its leader), and
    ``leader_group`` the gloo group of the stage roots (None on every other rank, and where
    only one stage is involved).
    """

    def __init__(self, name: str, rank: int, size: int, *, stage_group=None,
                 stage_root: Optional[int] = None, leader_group=None):
        super().__init__(rank, size)
        self.group_name_ = name
        self.stage_group, self.stage_root, self.leader_group = stage_group, stage_root, leader_group

    def getBackendName(self) -> str:
        return "ldt"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.group_name_}, rank={self.rank()}, size={self.size()})"

    @property
    def is_root(self) -> bool:
        return self.stage_root is None or self.stage_root == dist.get_rank()

    def _stage_size(self) -> int:
        return 1 if self.stage_group is None else self.stage_group.size()

    def _host_leg(self, tensor: torch.Tensor, collective, **kwargs) -> None:
        """On a stage root: run ``collective`` over the leaders with the tensor on the host."""
        if self.leader_group is None:
            return
        host = tensor.detach().to("cpu", copy=True)
        collective(host, group=self.leader_group, **kwargs)
        tensor.copy_(host)

    def _stage_broadcast(self, tensor: torch.Tensor) -> None:
        if self._stage_size() > 1:
            dist.broadcast(tensor, src=self.stage_root, group=self.stage_group)

    def barrier(self, opts=None):
        if self._stage_size() > 1:
            dist.barrier(group=self.stage_group)
        if self.is_root and self.leader_group is not None:
            dist.barrier(group=self.leader_group)
        if self._stage_size() > 1:
            dist.barrier(group=self.stage_group)
        return _Done()

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"{what} on {self!r}: ldt's cross-stage groups implement all_reduce, broadcast, "
            "all_gather (one member per stage) and barrier, what megatron-core issues on them; "
            "use a stage-local group (tensor/data parallel) for other collectives")

    def allgather(self, *args, **kwargs):
        self._unsupported("all_gather")

    def _allgather_base(self, *args, **kwargs):
        self._unsupported("all_gather_into_tensor")

    def reduce_scatter(self, *args, **kwargs):
        self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, *args, **kwargs):
        self._unsupported("reduce_scatter_tensor")

    def send(self, *args, **kwargs):
        self._unsupported("send (stage boundaries go through ldt.boundary.communicator)")

    def recv(self, *args, **kwargs):
        self._unsupported("recv (stage boundaries go through ldt.boundary.communicator)")


class StagePipelineGroup(CrossStageGroup):
    """One member per stage; rank = the stage's position in the group, size = member stages.

    What megatron calls the pipeline group (rank = stage index, size = stages) and the
    position-embedding group. A value megatron reduces or broadcasts over it is replicated on
    every TP rank of a stage, so only the leaders (``leaders``: global ranks, in member order)
    exchange it, then each broadcasts in its stage. Built without groups (``tp_group=None``)
    it only answers ``rank()`` / ``size()``.
    """

    def __init__(self, stage: int, num_stages: int, leaders: Sequence[int], *,
                 me: Optional[int] = None, tp_group=None, leader_group=None, name: str = "pp"):
        super().__init__(name, stage, num_stages, stage_group=tp_group,
                         stage_root=leaders[stage] if me is not None else None,
                         leader_group=leader_group)
        self._stage, self._size, self.leaders, self.me = stage, num_stages, tuple(leaders), me

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._size

    def members(self) -> list[int]:
        """This rank's view of the group: the leader of every other stage, itself for its own."""
        return [self.me if s == self._stage and self.me is not None else r
                for s, r in enumerate(self.leaders)]

    def __repr__(self) -> str:
        return f"StagePipelineGroup(stage={self._stage}, stages={self._size})"

    def _point_to_point(self, what: str):
        raise RuntimeError(
            f"{what} over ldt's pipeline group: megatron's own P2PCommunicator is running, so "
            "the schedule did not come from ldt's get_forward_backward_func. Apply ldt before "
            "the first schedule runs: ldt.job.megatron.activate(...) above initialize_model_parallel, "
            "or `python -m ldt.job.megatron --cluster FILE.yaml script.py`")

    def send(self, *args, **kwargs):
        self._point_to_point("send")

    def recv(self, *args, **kwargs):
        self._point_to_point("recv")

    def allreduce(self, tensors, opts=None):
        tensor = tensors[0]
        op = _op(opts)
        if op == ReduceOp.AVG:
            if self.is_root:
                self._host_leg(tensor, dist.all_reduce, op=ReduceOp.SUM)
                tensor.div_(self._size)
        elif self.is_root:
            self._host_leg(tensor, dist.all_reduce, op=op)
        self._stage_broadcast(tensor)
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):
        tensor = tensors[0]
        if self.is_root:
            self._host_leg(tensor, dist.broadcast, src=self.leaders[opts.rootRank])
        self._stage_broadcast(tensor)
        return _Done(tensors)

    def allgather(self, output_lists, input_tensors, opts=None):
        outs, tensor = output_lists[0], input_tensors[0]
        if self.is_root and self.leader_group is not None:
            host = [torch.empty_like(tensor, device="cpu") for _ in outs]
            dist.all_gather(host, tensor.detach().to("cpu"), group=self.leader_group)
            for out, h in zip(outs, host):
                out.copy_(h)
        elif self.leader_group is None:
            outs[0].copy_(tensor)
        for out in outs:
            self._stage_broadcast(out)
        return _Done(output_lists)


class EmbeddingGroup(StagePipelineGroup):
    """The first and last stage's copies of a tied, vocabulary-parallel word embedding.

    ``all_reduce`` of this rank's shard (dim 0, split by its own stage's TP size) leaves on
    every member its shard of the sum of the full tensors: each leader gathers its stage's
    shards, the leaders sum the full tensors on the host, and each scatters the sum back by its
    own TP split. This is what megatron's embedding-group all-reduce means (copy the embedding
    to the zero-initialized head at construction, sum the two gradients every step) when the
    two stages shard the vocabulary differently.
    """

    def allreduce(self, tensors, opts=None):
        if _op(opts) != ReduceOp.SUM:
            self._unsupported(f"all_reduce with {_op(opts)}")
        local = tensors[0]
        tp = self._stage_size()
        work = local.detach()
        if tp > 1:
            parts = [torch.empty_like(work) for _ in range(tp)] if self.is_root else None
            dist.gather(work.contiguous(), parts, dst=self.stage_root, group=self.stage_group)
            full = torch.cat(parts) if self.is_root else None
        else:
            full = work.clone()
        if self.is_root:
            self._host_leg(full, dist.all_reduce)
        if tp > 1:
            chunks = list(full.chunk(tp)) if self.is_root else None
            out = torch.empty_like(work)
            dist.scatter(out, chunks, src=self.stage_root, group=self.stage_group)
            work.copy_(out)
        else:
            work.copy_(full)
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):
        self._unsupported("broadcast of a vocabulary-parallel shard")

    def allgather(self, *args, **kwargs):
        self._unsupported("all_gather of a vocabulary-parallel shard")


class StageHierarchyGroup(CrossStageGroup):
    """Every rank of several stages: megatron's model-parallel and dist-optimizer groups.

    ``members``: global ranks in group-rank order; ``stage_group``: this rank's stage-local
    part of the group (its TP group, or TP x DP for a group over all replicas) whose
    ``stage_root`` is in ``leader_group`` with the other stages' roots. A reduction runs over
    the stage-local group, then the roots on the host, then back out in each stage.
    """

    def __init__(self, name: str, members: Sequence[int], me: int, *, stage_group,
                 stage_root: int, leader_group, stage_roots: dict[int, int]):
        members = list(members)
        super().__init__(name, members.index(me), len(members), stage_group=stage_group,
                         stage_root=stage_root, leader_group=leader_group)
        self.members_, self._stage_roots = members, stage_roots  # member -> its stage's root

    def members(self) -> list[int]:
        return list(self.members_)

    def allreduce(self, tensors, opts=None):
        tensor = tensors[0]
        op = _op(opts)
        reduce_op = ReduceOp.SUM if op == ReduceOp.AVG else op
        if self._stage_size() > 1:
            dist.all_reduce(tensor, op=reduce_op, group=self.stage_group)
        if self.is_root:
            self._host_leg(tensor, dist.all_reduce, op=reduce_op)
        self._stage_broadcast(tensor)
        if op == ReduceOp.AVG:
            tensor.div_(self.size())
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):
        tensor = tensors[0]
        src = self.members_[opts.rootRank]
        src_root = self._stage_roots[src]
        in_src_stage = self._stage_roots[dist.get_rank()] == src_root
        if in_src_stage and self._stage_size() > 1:
            dist.broadcast(tensor, src=src, group=self.stage_group)
        if self.is_root:
            self._host_leg(tensor, dist.broadcast, src=src_root)
        if not in_src_stage:
            self._stage_broadcast(tensor)
        return _Done(tensors)


class OneReplicaPerStageGroup(StageHierarchyGroup):
    """A :class:`StageHierarchyGroup` over every rank in which only replica 0 of each stage
    contributes to a reduction: megatron's gradient statistics (squared norm, found-inf,
    zero count) with per-stage DP and no distributed optimizer. After the DP reduce every
    replica of a stage holds the same gradient, and stages have different numbers of
    replicas, so summing them all would weight a stage by its dp; zeroing the other replicas'
    values counts each stage once (sums and maxima of non-negative statistics alike)."""

    def __init__(self, *args, counts: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts = counts

    def allreduce(self, tensors, opts=None):
        if _op(opts) not in (ReduceOp.SUM, ReduceOp.MAX):
            self._unsupported(f"all_reduce with {_op(opts)}")
        if not self.counts:
            tensors[0].zero_()
        return super().allreduce(tensors, opts)


def register(group: dist.ProcessGroup, members: Sequence[int], name: str) -> None:
    """Make ``group`` known to torch.distributed as a group over ``members`` (this rank's view).

    ``torch.distributed`` maps a group to its ranks in private tables that ``new_group`` fills;
    a Python process group must be entered there for ``get_rank(group)``,
    ``get_process_group_ranks(group)`` and ``broadcast(src=global rank)`` to work.
    """
    world = dist.distributed_c10d._world
    world.pg_group_ranks[group] = {r: i for i, r in enumerate(members)}
    world.pg_names[group] = name
    world.pg_map[group] = ("ldt", None)


def unregister(group: dist.ProcessGroup) -> None:
    world = dist.distributed_c10d._world
    for table in (world.pg_group_ranks, world.pg_names, world.pg_map):
        table.pop(group, None)
