"""The memory estimate's measuring side: each stage's real chunks on fake tensors, in a process
of its own (:func:`ldt.memory.estimate` starts it by name, so the launcher never loads
megatron-core for it), or in this one (:func:`estimate_here`)."""

from __future__ import annotations

import torch.distributed as dist

from ldt.config import typed_config
from ldt.groups.parallel_state import destroy_vtp, initialize_vtp
from ldt.memory import GIB, StageEstimate, recv_bytes
from ldt.memory.fake import fake_rank
from ldt.memory.inflight import stage_inflight
from ldt.memory.measure import cpu_topology, measure_stage
from ldt.models.recompute import describe, stage_recompute
from ldt.plan.zb_prices import run_prices
from ldt.topology.validate import validate
from ldt.training import moe


def estimate_here(cfg: dict, attention: str = "auto") -> list[StageEstimate]:
    """:func:`estimate` in this process, which must have no process group: while it measures a
    stage it is a rank of a fake world (:func:`ldt.memory.fake.fake_rank`), and leaves it
    after (megatron-core's globals reset, ldt's patches reverted)."""
    if dist.is_initialized():
        raise RuntimeError("estimate_here needs a process without a process group (it becomes "
                           "a rank of a fake world); call ldt.memory.estimate instead")
    return estimate_worker(0, 1, cfg, attention)


def _transients(chunks) -> list[int]:
    """Each chunk's transient, with what the process makes once (in the first chunk's measure)
    counted for every chunk: an edge's end chunk runs its micro-batches with megatron's global
    attention buffer and the causal mask already there."""
    once = sum(ch.once for ch in chunks)
    return [ch.transient - ch.once + once for ch in chunks]


def estimate_worker(rank: int, world: int, cfg: dict, attention: str) -> list[StageEstimate]:
    """The estimate of every stage, in a process without a process group (the helper rank
    of :func:`ldt.memory.estimate`, or :func:`estimate_here`'s)."""
    c = typed_config(cfg)
    topo = validate(c.cluster, c.model, train=c.train, check_devices=False)
    # a zero-bubble run's order comes from its plan's prices: the lists it will walk
    priced = run_prices(c.cluster, c.model, c.train) if c.train.schedule == "zb" else None
    schedule = stage_inflight(topo, c.train, c.model.sequence_parallel, priced)
    out = []
    on_cpu = cpu_topology(topo)  # built here whatever the devices (sizes do not depend on it)
    m = c.model
    experts = (m.moe_router_topk, m.num_moe_experts) if m.num_moe_experts else None
    for st in topo.stages:
        leader = topo.leader(st.index)
        with fake_rank(topo.world_size, leader, experts):
            moe.reset(m)  # megatron's aux-loss tracker, sized for the model's global layers
            state = initialize_vtp(on_cpu)
            try:
                got = measure_stage(c, on_cpu, state, st.device, attention)
            finally:
                destroy_vtp()
        cluster_stage = c.cluster.stages[st.index]
        activations = [ch.activations for ch in got.chunks]
        # one moment of the schedule: what is held while one computation runs (held
        # micro-batches, posted receives, sent tensors), its chunk's transient on top
        transients = _transients(got.chunks)
        shards = st.tp if c.model.sequence_parallel and st.tp > 1 else 1
        wstore = [ch.wstore for ch in got.chunks] if priced is not None else []
        wgrad = [ch.wgrad_transient for ch in got.chunks]
        at = schedule[st.index].peak(activations, transients,
                                     recv_bytes(got.boundary_tensor, shards),
                                     got.boundary_tensor, wstore, wgrad)
        limit = cluster_stage.memory_gib
        out.append(StageEstimate(
            st.index, st.name, st.device, st.tp, topo.dp_of(st.index),
            [r for d in range(topo.dp_of(st.index)) for r in topo.stage_ranks(st.index, d)],
            describe(stage_recompute(c.model, cluster_stage)), got.attention, got.weights,
            got.grads, got.main_params, got.optimizer, activations, at.chunks,
            (wgrad if at.w else transients)[at.chunk], at.recv_buffers, got.boundary_tensor,
            got.step_transient, None if limit is None else limit * GIB,
            c.train.distributed_optimizer, at.sent, shards,
            wstore=wstore, wstore_held=at.wstore if wstore else (),
            snapshot_part=got.snapshot))
    return out
