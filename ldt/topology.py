"""Topology: who is in which stage. The one place that knows the rank layout.

Ranks are contiguous per stage and the data-parallel replica is outermost::

    rank = dp_rank * replica_size + stage_offset[stage] + tp_rank

where ``replica_size = sum(stage tp)``. The first rank of a stage (TP rank 0) is its *leader*:
the only rank that talks to neighbouring stages. Everything else (parallel state, p2p, the
trainer) asks this object instead of recomputing the layout.

``python -m ldt.topology cluster=cpu_demo`` prints the rank map of a config.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

from ldt.config import DEVICE_TYPES, ConfigError, ModelConfig, to_cluster
from ldt.device import BoundaryPlan, plan_boundary
from ldt.layout import LayerSplit


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    device: str
    tp: int


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
        if self.u_shape and len(self.stages) < 2:
            raise ConfigError(
                "cluster.u_shape=true needs at least 2 stages (an edge and a cloud stage), "
                f"got {len(self.stages)}; add a stage or set cluster.u_shape=false"
            )
        if self.split is not None and self.split.num_stages != len(self.stages):
            raise ConfigError(
                f"layer split is for {self.split.num_stages} stages, cluster has {len(self.stages)}"
            )

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, cluster, model: Optional[ModelConfig] = None) -> "Topology":
        """Build from a cluster config; with a model, also split its layers (validated)."""
        cluster = to_cluster(cluster)
        if cluster.host_staging not in ("auto", "always"):
            raise ConfigError(
                f"cluster.host_staging={cluster.host_staging!r}; use 'auto' or 'always'"
            )
        stages = tuple(
            Stage(i, s.name, s.device, int(s.tp)) for i, s in enumerate(cluster.stages)
        )
        topo = cls(stages, dp=int(cluster.dp), u_shape=bool(cluster.u_shape),
                   force_host_staging=cluster.host_staging == "always")
        if model is None:
            return topo
        from ldt.layout import split_layers

        split = split_layers(model.num_layers, len(stages), u_shape=topo.u_shape,
                             layout=cluster.layout, min_chunk_layers=1)
        return cls(stages, topo.dp, topo.u_shape, split, topo.force_host_staging)

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
        return self.dp * self.replica_size

    @cached_property
    def _offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.stages:
            out.append(acc)
            acc += s.tp
        return tuple(out)

    # ---- questions by rank / stage --------------------------------------------------------
    def stage_ranks(self, stage: int, dp_rank: int = 0) -> tuple[int, ...]:
        """Global ranks of one stage in one replica, TP rank order (the stage's TP group)."""
        start = dp_rank * self.replica_size + self._offsets[stage]
        return tuple(range(start, start + self.stages[stage].tp))

    def leader(self, stage: int, dp_rank: int = 0) -> int:
        return self.stage_ranks(stage, dp_rank)[0]

    def leaders(self, dp_rank: int = 0) -> tuple[int, ...]:
        """Leaders of every stage of one replica, in pipeline order."""
        return tuple(self.leader(s, dp_rank) for s in range(self.num_stages))

    def dp_ranks(self, stage: int, tp_rank: int) -> tuple[int, ...]:
        """The same (stage, TP rank) position in every replica: one data-parallel group."""
        return tuple(self.stage_ranks(stage, d)[tp_rank] for d in range(self.dp))

    def rank_info(self, rank: int) -> RankInfo:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        dp_rank, local = divmod(rank, self.replica_size)
        for s in reversed(self.stages):
            if local >= self._offsets[s.index]:
                tp_rank = local - self._offsets[s.index]
                return RankInfo(rank, s.index, tp_rank, dp_rank, tp_rank == 0, s.device)
        raise AssertionError("unreachable")

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
        return [
            plan_boundary(a, self.stages[a].device, b, self.stages[b].device,
                          self.force_host_staging)
            for a, b in pairs
        ]

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
                         f"{info.tp_rank}/{st.tp}", f"{info.dp_rank}/{self.dp}",
                         "*" if info.is_leader else "", layers))
        widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        kind = "U-shape (stage 0 = edge: first and last layers, loss)" if self.u_shape else "pipeline"
        title = (f"ldt topology: {self.num_stages} stages, TP {self.tp_sizes}, dp {self.dp}, "
                 f"world {self.world_size}, {kind}")
        links = ", ".join(f"{b.src_stage}->{b.dst_stage}:{b.transport.value}"
                          for b in self.boundaries())
        return "\n".join([title, *lines, f"boundaries: {links or '-'}"])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ldt.topology [hydra flags] [overrides]``: print the rank map of a config.

    A Hydra app over the same ``conf/`` as ``ldt-train`` (so ``--help``, ``--cfg job`` and
    ``--config-dir`` work alike); it validates the config (not the devices: a rank map of a
    GPU/NPU cluster is printed on any machine) and starts nothing.
    """
    from ldt.hydra_app import run_app

    return run_app(_print_rank_map, argv, run_folder=False)


def _print_rank_map(cfg) -> int:
    from hydra.core.hydra_config import HydraConfig

    from ldt.hydra_app import EXIT_CONFIG
    from ldt.validate import validate

    try:
        topo = validate(cfg.cluster, cfg.model, world_size=None, train=cfg.train,
                        check_devices=False)
    except ValueError as exc:  # ConfigError, LayoutError
        print(f"ldt: invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    choices = HydraConfig.get().runtime.choices
    print(f"cluster={choices.get('cluster')} model={choices.get('model')}")
    print(topo.rank_map())
    return 0


if __name__ == "__main__":
    from ldt.topology import main as _main  # this module's functions, not __main__'s copies

    sys.exit(_main())
