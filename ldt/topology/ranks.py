"""Topology: who is in which stage. The one place that knows the rank layout.

Ranks are contiguous per stage and the data-parallel replica is outermost::

    rank = dp_rank * replica_size + stage_offset[stage] + tp_rank

where ``replica_size = sum(stage tp)``. With per-stage DP (VDP: stage ``s`` has ``dp_s``
replicas, ``dp = max dp_s``) the same order holds with the missing replicas left out: replica
``d`` of every stage with ``dp_s > d``, in stage order, for ``d = 0 .. dp-1`` (so a uniform
cluster keeps the formula above). World size = sum over stages of tp * dp_s. The first rank of
a stage (TP rank 0) is its *leader*:
the only rank that talks to neighbouring stages. Everything else (parallel state, p2p, the
trainer) asks this object instead of recomputing the layout.

``ldt-rankmap cluster=cpu_demo`` prints the rank map of a config
(:mod:`ldt.tools.rankmap`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from ldt.config import DEVICE_TYPES, ConfigError, ModelConfig, to_cluster
from ldt.config.layout import LayerSplit
from ldt.config.layout import split_layers
from ldt.topology.device import BoundaryPlan, plan_boundary
from ldt.topology.transport import fanout_boundary

FANOUT_MODES = ("auto", "never", "always")  # cluster.boundary_fanout


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    device: str
    tp: int
    ep: int = 1  # expert parallelism over the stage's TP ranks (MoE models)

    @property
    def etp(self) -> int:
        """The TP size of each expert: the TP ranks the experts are not spread over."""
        return self.tp // self.ep


@dataclass(frozen=True)
class RankInfo:
    rank: int
    stage: int
    tp_rank: int
    dp_rank: int
    is_leader: bool
    device: str


@dataclass(frozen=True)
class Topology:
    stages: tuple[Stage, ...]
    dp: int = 1
    u_shape: bool = False
    split: Optional[LayerSplit] = None
    force_host_staging: bool = False
    link_delay_ms: tuple[float, ...] = ()
    """Emulated delay per boundary, in :meth:`boundaries` order (empty: none)."""
    stage_dp: tuple[int, ...] = ()
    """Per-stage DP sizes when they differ (VDP); empty: every stage has ``dp`` replicas.
    ``dp`` is then the largest of them (the uniform-DP run with the same global batch)."""
    boundary_fanout: str = "auto"
    """``cluster.boundary_fanout``: ``auto``, ``never`` or ``always``."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ConfigError("cluster.stages is empty; list at least one stage")
        if self.dp < 1:
            raise ConfigError(f"cluster.dp={self.dp} must be >= 1; set cluster.dp=1 for one replica")
        for s in self.stages:
            if s.device not in DEVICE_TYPES:
                raise ConfigError(
                    f"cluster.stages[{s.index}].device={s.device!r} is unknown; "
                    f"use one of {', '.join(DEVICE_TYPES)}"
                )
            if s.tp < 1:
                raise ConfigError(f"cluster.stages[{s.index}].tp={s.tp} must be >= 1")
            if s.ep < 1 or s.tp % s.ep:
                ok = [e for e in range(1, s.tp + 1) if s.tp % e == 0]
                raise ConfigError(
                    f"cluster.stages[{s.index}].ep={s.ep} ({s.name}): expert parallelism "
                    f"spreads the experts over the stage's TP ranks, so it must divide its "
                    f"tp={s.tp}; use one of {ok}")
        if self.u_shape and len(self.stages) < 2:
            raise ConfigError(
                "cluster.u_shape=true needs at least 2 stages (an edge and a cloud stage), "
                f"got {len(self.stages)}; add a stage or set cluster.u_shape=false"
            )
        if self.boundary_fanout not in FANOUT_MODES:
            raise ConfigError(f"cluster.boundary_fanout={self.boundary_fanout!r}; use one of "
                              f"{', '.join(FANOUT_MODES)}")
        if self.stage_dp:
            self._check_stage_dp()
        if self.split is not None and self.split.num_stages != len(self.stages):
            raise ConfigError(
                f"layer split is for {self.split.num_stages} stages, cluster has {len(self.stages)}"
            )

    def _check_stage_dp(self) -> None:
        """Per-stage DP: every size >= 1, dp = the largest, and at every boundary that carries
        activations one side's size divides the other's (a replica then talks to one replica,
        or to a fixed set of them, on the other side: ldt.schedule.routing)."""
        if len(self.stage_dp) != len(self.stages):
            raise ConfigError(f"{len(self.stage_dp)} stage dp sizes for {len(self.stages)} stages")
        for s, d in zip(self.stages, self.stage_dp):
            if d < 1:
                raise ConfigError(f"cluster.stages[{s.index}].dp={d} ({s.name}) must be >= 1")
        if self.dp != max(self.stage_dp):
            raise ConfigError(f"dp={self.dp} must be the largest stage dp, {max(self.stage_dp)}")
        for a, b in self.activation_boundaries():
            da, db = self.stage_dp[a], self.stage_dp[b]
            if da % db and db % da:
                sa, sb = self.stages[a], self.stages[b]
                fix_b = sorted({d for d in (1, da, 2 * da) if da % d == 0 or d % da == 0}
                               | {x for x in range(1, da + 1) if da % x == 0})
                raise ConfigError(
                    f"cluster.stages[{a}].dp={da} ({sa.name}) and cluster.stages[{b}].dp={db} "
                    f"({sb.name}) share the boundary {a}->{b}, where one side's dp must divide "
                    f"the other's (each replica then serves a fixed set of replicas across it); "
                    f"set cluster.stages[{b}].dp to one of {fix_b[:6]}, or change "
                    f"cluster.stages[{a}].dp")
        for s, d in zip(self.stages, self.stage_dp):
            if self.dp % d:
                ok = [x for x in range(1, self.dp + 1) if self.dp % x == 0]
                raise ConfigError(
                    f"cluster.stages[{s.index}].dp={d} ({s.name}) does not divide the largest "
                    f"stage dp, {self.dp}: a step runs {self.dp} x train.num_microbatches "
                    f"micro-batches, shared evenly by each stage's replicas; use one of {ok}")

    def activation_boundaries(self) -> list[tuple[int, int]]:
        """The stage pairs ``(s, s+1)`` activations cross; with a U-shape also ``(P-1, 0)``."""
        n = self.num_stages
        pairs = [(i, i + 1) for i in range(n - 1)]
        return pairs + [(n - 1, 0)] if self.u_shape and n > 1 else pairs

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, cluster, model: Optional[ModelConfig] = None) -> "Topology":
        """Build from a cluster config; with a model, also split its layers (validated)."""
        cluster = to_cluster(cluster)
        if not cluster.stages and cluster.inventory:
            raise ConfigError(
                f"cluster.inventory={cluster.inventory!r} (elastic): the stages are planned at "
                "every torchrun start from the nodes there (docs/elastic.md); preview a plan "
                f"with ldt-plan --inventory {cluster.inventory} --model NAME")
        if cluster.host_staging not in ("auto", "always"):
            raise ConfigError(
                f"cluster.host_staging={cluster.host_staging!r}; use 'auto' or 'always'"
            )
        stages = tuple(
            Stage(i, s.name, s.device, int(s.tp), int(s.ep)) for i, s in enumerate(cluster.stages)
        )
        if int(cluster.dp) < 1:
            raise ConfigError(f"cluster.dp={cluster.dp} must be >= 1; set cluster.dp=1 for one "
                              "replica")
        dps = tuple(int(cluster.dp if s.dp is None else s.dp) for s in cluster.stages)
        stage_dp = dps if len(set(dps)) > 1 else ()
        topo = cls(stages, dp=max(dps, default=int(cluster.dp)), u_shape=bool(cluster.u_shape),
                   force_host_staging=cluster.host_staging == "always",
                   link_delay_ms=_link_delays(cluster.link_delay_ms, len(stages),
                                              bool(cluster.u_shape)),
                   stage_dp=stage_dp, boundary_fanout=str(cluster.boundary_fanout))
        if model is None:
            return topo

        split = split_layers(model.num_layers, len(stages), u_shape=topo.u_shape,
                             layout=cluster.layout, min_chunk_layers=1,
                             num_mtp=getattr(model, "mtp_num_layers", 0))
        return cls(stages, topo.dp, topo.u_shape, split, topo.force_host_staging,
                   topo.link_delay_ms, stage_dp, topo.boundary_fanout)

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def tp_sizes(self) -> list[int]:
        return [s.tp for s in self.stages]

    @property
    def replica_size(self) -> int:
        """Ranks in one pipeline replica: the sum of the stages' TP sizes."""
        return sum(self.tp_sizes)

    @property
    def world_size(self) -> int:
        return sum(s.tp * self.dp_of(s.index) for s in self.stages)

    @property
    def is_vdp(self) -> bool:
        """Stages have different numbers of replicas (VDP)."""
        return bool(self.stage_dp)

    def dp_of(self, stage: int) -> int:
        """Data-parallel replicas of one stage."""
        return self.stage_dp[stage] if self.stage_dp else self.dp

    @property
    def dp_sizes(self) -> list[int]:
        return [self.dp_of(s) for s in range(self.num_stages)]

    @cached_property
    def _first_ranks(self) -> dict[tuple[int, int], int]:
        """(stage, dp rank) -> the first global rank of that stage replica (module docstring)."""
        out, acc = {}, 0
        for d in range(self.dp):
            for s in self.stages:
                if d < self.dp_of(s.index):
                    out[(s.index, d)] = acc
                    acc += s.tp
        return out

    @cached_property
    def _rank_infos(self) -> tuple[RankInfo, ...]:
        infos = []
        for (stage, d), first in sorted(self._first_ranks.items(), key=lambda kv: kv[1]):
            st = self.stages[stage]
            infos += [RankInfo(first + t, stage, t, d, t == 0, st.device) for t in range(st.tp)]
        return tuple(infos)

    # ---- questions by rank / stage --------------------------------------------------------
    def stage_ranks(self, stage: int, dp_rank: int = 0) -> tuple[int, ...]:
        """Global ranks of one stage in one replica, TP rank order (the stage's TP group)."""
        start = self._first_ranks[(stage, dp_rank)]
        return tuple(range(start, start + self.stages[stage].tp))

    def leader(self, stage: int, dp_rank: int = 0) -> int:
        return self.stage_ranks(stage, dp_rank)[0]

    def leaders(self, dp_rank: int = 0) -> tuple[int, ...]:
        """Leaders of every stage of one replica, in pipeline order. With per-stage DP,
        replica ``dp_rank`` of the uniform-DP run: stage ``s``'s replica ``dp_rank % dp_s``."""
        return tuple(self.leader(s, dp_rank % self.dp_of(s)) for s in range(self.num_stages))

    def dp_ranks(self, stage: int, tp_rank: int) -> tuple[int, ...]:
        """The same (stage, TP rank) position in every replica: one data-parallel group."""
        return tuple(self.stage_ranks(stage, d)[tp_rank] for d in range(self.dp_of(stage)))

    def expert_groups(self, stage: int, dp_rank: int = 0) -> tuple[list, list]:
        """(expert-parallel groups, expert-TP groups) of one stage replica, as rank lists.

        Expert parallelism folds onto the stage's TP ranks (megatron's expert grid
        ``etp x ep x edp = tp x dp`` with ``etp = tp / ep``, tensor-parallel fastest): TP
        rank ``t`` has expert-TP rank ``t % etp`` and expert-parallel rank ``t // etp``, so
        each expert-TP group is a block of ``etp`` consecutive TP ranks and each
        expert-parallel group takes one rank of every block. The expert data-parallel group
        is then the stage's data-parallel group: the experts never leave their stage."""
        st, ranks = self.stages[stage], self.stage_ranks(stage, dp_rank)
        ep_groups = [[ranks[j + st.etp * k] for k in range(st.ep)] for j in range(st.etp)]
        etp_groups = [list(ranks[k * st.etp:(k + 1) * st.etp]) for k in range(st.ep)]
        return ep_groups, etp_groups

    def rank_info(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return self._rank_infos[rank]

    def next_stage(self, stage: int) -> int:
        """The stage activations go to (wraps last -> first: the U-shape's return path)."""
        return (stage + 1) % self.num_stages

    def prev_stage(self, stage: int) -> int:
        return (stage - 1) % self.num_stages

    def is_end_stage(self, stage: int) -> bool:
        """Stage 0 of a U-shape also runs the end chunk (head + loss)."""
        return self.u_shape and stage == 0

    def loss_stage(self) -> int:
        """The stage that computes the loss and owns the labels."""
        return 0 if self.u_shape else self.num_stages - 1

    def data_stages(self) -> tuple[int, ...]:
        """Stages that read data (tokens on the first stage, labels on the loss stage)."""
        return tuple(sorted({0, self.loss_stage()}))

    def boundaries(self) -> list[BoundaryPlan]:
        """Transport of every directed stage boundary ``s -> s+1``, including the wraparound
        ``P-1 -> 0`` (the U-shape's return path; interleaved schedules use it as well)."""
        n = self.num_stages
        pairs = [(i, (i + 1) % n) for i in range(n)] if n > 1 else []
        delays = self.link_delay_ms or (0.0,) * len(pairs)
        return [
            plan_boundary(a, self.stages[a].device, b, self.stages[b].device,
                          self.force_host_staging, delay)
            for (a, b), delay in zip(pairs, delays)
        ]

    def fanout_boundaries(self) -> list[BoundaryPlan]:
        """The boundaries where a sending stage may send straight to every TP rank of the stage
        across (:func:`ldt.topology.transport.fanout_boundary`)."""
        return [b for b in self.boundaries()
                if fanout_boundary(self.boundary_fanout, self.stages[b.src_stage].tp,
                                   self.stages[b.dst_stage].tp, self.is_vdp)]

    def boundary(self, src_stage: int, dst_stage: int) -> BoundaryPlan:
        for b in self.boundaries():
            if {b.src_stage, b.dst_stage} == {src_stage, dst_stage}:
                return b
        raise ValueError(f"stages {src_stage} and {dst_stage} share no boundary")

    # ---- display ----------------------------------------------------------------------------
    def rank_map(self) -> str:
        """A table: rank, stage, device, TP rank, DP rank, leader?, layers."""
        head = ("rank", "stage", "device", "tp_rank", "dp_rank", "leader", "layers")
        rows = [head]
        for r in range(self.world_size):
            info = self.rank_info(r)
            st = self.stages[info.stage]
            layers = self.split.describe(info.stage) if self.split is not None else "?"
            rows.append((str(r), f"{st.index}:{st.name}", st.device,
                         f"{info.tp_rank}/{st.tp}", f"{info.dp_rank}/{self.dp_of(st.index)}",
                         "*" if info.is_leader else "", layers))
        widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        kind = "U-shape (stage 0 = edge: first and last layers, loss)" if self.u_shape else "pipeline"
        dp = f"dp per stage {self.dp_sizes} (VDP)" if self.is_vdp else f"dp {self.dp}"
        title = (f"ldt topology: {self.num_stages} stages, TP {self.tp_sizes}, {dp}, "
                 f"world {self.world_size}, {kind}")
        links = ", ".join(f"{b.src_stage}->{b.dst_stage}:{b.transport.value}"
                          + (f"+{b.delay_ms:g}ms delay" if b.delay_ms else "")
                          for b in self.boundaries())
        return "\n".join([title, *lines, f"boundaries: {links or '-'}"])


def _link_delays(value, num_stages: int, u_shape: bool) -> tuple[float, ...]:
    """``cluster.link_delay_ms`` as one delay per boundary (see ClusterConfig)."""
    boundaries = num_stages if num_stages > 1 else 0
    order = ", ".join(f"{i}->{(i + 1) % num_stages}" for i in range(boundaries))
    if isinstance(value, bool):
        raise ConfigError(f"cluster.link_delay_ms={value!r}; give milliseconds, not a boolean")
    if value is None or isinstance(value, (int, float)):
        values = [float(value or 0.0)] * boundaries
    elif not isinstance(value, (str, bytes)) and hasattr(value, "__iter__"):
        values = list(value)
        if len(values) == boundaries - 1 and not u_shape:  # a plain pipeline: no return path
            values.append(0.0)
        if len(values) != boundaries:
            raise ConfigError(
                f"cluster.link_delay_ms={list(value)} has {len(list(value))} entries; give one "
                f"number for every boundary, or one per boundary in the order {order}")
    else:
        raise ConfigError(f"cluster.link_delay_ms={value!r}; give a number of milliseconds or a "
                          f"list with one per boundary ({order})")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ConfigError(f"cluster.link_delay_ms entry {i} ({v!r}) must be a finite number "
                              "of milliseconds >= 0")
    values = [float(v) for v in values]
    return tuple(values) if any(values) else ()
