"""Micro-batch -> replica routing with per-stage data parallelism (VDP), in one place.

The semantics are those of uniform DP with ``D = max dp_s`` replicas, ``m`` micro-batches each:
every step processes ``D * m`` micro-batches, every layer sees each once. They carry one global
id ``g = j * D + v``: micro-batch ``j`` of the uniform run's replica ``v`` (:func:`virtual_of`),
so ascending ids interleave the uniform run's replicas.

A stage with ``dp_s`` replicas runs micro-batch ``g`` on replica :func:`replica_of` ``= g mod
dp_s``: each of its replicas runs ``m * D / dp_s`` micro-batches per step, in ascending ``g``.
Because one side's dp divides the other's at every boundary, replica ``r`` of a stage exchanges
messages with a fixed set of replicas of its neighbour: one (fan-in side) or ``dp_b / dp_a`` of
them in turn (fan-out side), :func:`boundary_pairs`. Both ends of a boundary walk their shared
micro-batches in the same (ascending) order, so each replica-to-replica channel stays FIFO.

The schedule generator (:mod:`ldt.schedule.vdp`) runs one action list per *lane* = (stage,
replica), numbered by :class:`Lanes`; the deadlock checker, the simulator and the runtime see
lanes where a uniform schedule has stages. The data stages read micro-batch ``g`` as the uniform
run's replica ``virtual_of(g)[0]`` would (its micro-batch ``virtual_of(g)[1]``), so samples and
labels stay on the replicas of the data stages that own them (the U-shape's edge).

No torch here: tools and tests use it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def replica_of(mb: int, stage_dp: int, step: int = 0) -> int:
    """The replica (of a stage with ``stage_dp`` replicas) that runs global micro-batch ``mb``
    at ``step``. The same every step; ``step`` is here so that a rotation (e.g. to balance a
    remainder) would change this one function and nothing else."""
    return mb % stage_dp


def virtual_of(mb: int, dp_max: int) -> tuple[int, int]:
    """``(v, j)``: global micro-batch ``mb`` is the uniform-DP run's replica ``v``'s ``j``-th."""
    return mb % dp_max, mb // dp_max


def microbatches_of(replica: int, stage_dp: int, num_microbatches: int, dp_max: int,
                    step: int = 0) -> list[int]:
    """The global micro-batches one replica of a stage runs in a step, in order."""
    return [g for g in range(num_microbatches * dp_max)
            if replica_of(g, stage_dp, step) == replica]


def boundary_pairs(dp_a: int, dp_b: int, dp_max: int) -> list[tuple[int, int]]:
    """The (replica of a, replica of b) pairs that exchange messages across a boundary."""
    return sorted({(replica_of(v, dp_a), replica_of(v, dp_b)) for v in range(dp_max)})


def grad_factor(stage_dp: int, loss_dp: int) -> float:
    """The factor that makes a VDP stage's gradient equal the uniform-DP reference's, applied
    after the usual data-parallel *average* over the stage's ``stage_dp`` replicas.

    Why: the loss stage divides each micro-batch's loss by the number of micro-batches its
    replica runs, ``m * D / loss_dp`` (megatron's ``forward_step``). A stage's gradient summed
    over its replicas is then ``loss_dp / (m * D)`` times the sum over all micro-batches; the
    reference has ``1 / (m * D)``. The average divides by ``stage_dp``, so the missing factor is
    ``stage_dp / loss_dp`` (1 with uniform DP; 1/2 for an edge of dp 1 before a loss stage of
    dp 2; 2 for dp 2 before a loss stage of dp 1).

    With megatron's ``DistributedDataParallel`` (which averages over the stage's DP group when
    ``average_in_collective`` or its default ``gradient_scaling_factor = 1 / dp`` is used),
    apply it once per step after ``finalize_model_grads`` and before the norm / clipping:
    ``for chunk in model: chunk.scale_gradients(grad_factor(dp_s, dp_loss))``; or fold it into
    DDP's gradient_scaling_factor (``stage_dp / loss_dp / stage_dp = 1 / loss_dp``).
    """
    return stage_dp / loss_dp


@dataclass(frozen=True)
class Lanes:
    """Lanes (stage, replica) numbered stage-major: lane ids of stage ``s`` are contiguous."""

    stage_dp: tuple[int, ...]

    @cached_property
    def _pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple((s, r) for s, d in enumerate(self.stage_dp) for r in range(d))

    @property
    def dp_max(self) -> int:
        return max(self.stage_dp)

    def __len__(self) -> int:
        return len(self._pairs)

    def lane(self, stage: int, replica: int) -> int:
        return sum(self.stage_dp[:stage]) + replica

    def of(self, lane: int) -> tuple[int, int]:
        """``(stage, replica)`` of a lane id."""
        return self._pairs[lane]

    def peer(self, stage: int, mb: int, step: int = 0) -> int:
        """The lane of ``stage`` that runs micro-batch ``mb``."""
        return self.lane(stage, replica_of(mb, self.stage_dp[stage], step))

    def name(self, lane: int) -> str:
        stage, replica = self.of(lane)
        return f"{stage}.{replica}"
