"""The memory estimate: what each rank of a config holds at its peak, before anything runs.

:func:`estimate` answers "does this config fit, and where does the memory go?" at real size
on any machine, in seconds, without allocating the model: one helper process becomes, in
turn, the first rank of every stage of the real world (:mod:`ldt.memory.fake`: torch's fake
tensors and fake process group), builds that stage with the code that trains it, counts its
resident memory and runs two micro-batches through megatron-core (:mod:`ldt.memory.measure`),
and multiplies the activations by the micro-batches the run's schedule really keeps in flight
at its fullest moment (:mod:`ldt.memory.inflight`: held micro-batches, posted receives and
sent tensors counted at the same computation, not each at its own maximum). Every rank of a
stage holds the same (TP shards and replicas are alike), so one per stage is measured. Per
rank::

    peak = max(weights + grads + main params + optimizer states          (resident)
               + sum over chunks of activations per micro-batch x in flight
               + (receive buffers + sent tensors still held) x one boundary tensor
               + sum over chunks of a W store entry x entries held   (train.schedule=zb)
               + the largest transient of one micro-batch's forward and backward,
               resident + the optimizer step's transient)

``ldt-memory`` prints it (:mod:`ldt.tools.memory`), ``ldt-train`` prints it with the rank map
and refuses a config that exceeds a stage's ``memory_gib`` (:func:`ldt.memory.report.refusal`);
docs/memory.md says what is counted and how it compares with real allocations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ldt.launch import local

GIB = 2**30


@dataclass
class StageEstimate:
    """One stage's per-rank estimate, bytes."""

    index: int
    name: str
    device: str
    tp: int
    dp: int
    ranks: list[int]
    recompute: str
    attention: str
    weights: int
    grads: int
    main_params: int
    optimizer: int
    activations: list[int]
    """Per chunk: bytes one micro-batch leaves alive after the forward."""
    inflight: tuple[int, ...]
    """Per chunk: micro-batches held at the schedule's peak."""
    transient: int
    recv_buffers: int
    boundary_tensor: int
    step_transient: int
    limit: Optional[float] = None
    """``cluster.stages[i].memory_gib`` in bytes (None: not stated)."""
    distributed_optimizer: bool = False
    sent: int = 0
    """Sent tensors ldt's runtime still holds at the peak (it waits for sends at the step's
    end), one boundary tensor each."""
    shards: int = 1
    """Sequence-parallel slices of the stage (1 without): a posted receive holds the leader's
    whole tensor and the slice it scatters into."""
    extra: dict = field(default_factory=dict)
    wstore: list[int] = field(default_factory=list)
    """``train.schedule=zb``, per chunk: bytes one micro-batch's W store entry holds from its B
    to its W (the split linear layers' inputs and output gradients); empty otherwise."""
    wstore_held: tuple[int, ...] = ()
    """Per chunk: W store entries held at the schedule's peak."""
    snapshot_part: int = 0
    """Bytes of one snapshot part's files (:func:`ldt.training.flat_state.part_bytes`: the
    state, the buffer's alignment, its index, the part's meta and manifest)."""

    @property
    def resident(self) -> int:
        return self.weights + self.grads + self.main_params + self.optimizer

    @property
    def snapshot_bytes(self) -> int:
        """One generation of the rank's snapshot (``train.snapshot_dir``, in host memory): its
        state as it holds it, weights, fp32 main params, optimizer states
        (:func:`ldt.training.snapshot.live_state`), gradients not part of it, or its part's
        files (:attr:`snapshot_part`), whichever is larger."""
        return max(self.weights + self.main_params + self.optimizer, self.snapshot_part)

    @property
    def activation_bytes(self) -> int:
        return sum(a * n for a, n in zip(self.activations, self.inflight))

    @property
    def wstore_bytes(self) -> int:
        return sum(w * n for w, n in zip(self.wstore, self.wstore_held))

    @property
    def buffer_bytes(self) -> int:
        return self.recv_buffers * self.recv_tensor + self.sent * self.boundary_tensor

    @property
    def recv_tensor(self) -> int:
        return recv_bytes(self.boundary_tensor, self.shards)

    @property
    def peak_transient(self) -> int:
        """The transient at the rank's peak: one micro-batch's forward and backward on top of
        everything in flight, or the optimizer step's on top of the resident part."""
        pipeline = (self.activation_bytes + self.buffer_bytes + self.wstore_bytes
                    + self.transient)
        return self.transient if pipeline >= self.step_transient else self.step_transient

    @property
    def peak(self) -> int:
        during_pipeline = (self.resident + self.activation_bytes + self.buffer_bytes
                           + self.wstore_bytes + self.transient)
        return max(during_pipeline, self.resident + self.step_transient)

    @property
    def fits(self) -> bool:
        return self.limit is None or self.peak <= self.limit

    def components(self) -> dict[str, int]:
        out = {"weights": self.weights, "gradients": self.grads,
               "fp32 main params": self.main_params, "optimizer states": self.optimizer,
               "activations": self.activation_bytes, "receive buffers": self.buffer_bytes,
               "transient": self.peak_transient}
        if self.wstore:
            out["W store"] = self.wstore_bytes
        return out


def recv_bytes(boundary_tensor: int, shards: int) -> int:
    """One posted receive: the whole tensor (the leader's), and with sequence parallelism
    (``shards`` > 1 slices) the slice that is scattered into, posted with it (measured:
    cpu_demo's TP 2 leader)."""
    return boundary_tensor + (boundary_tensor // shards if shards > 1 else 0)


def estimate(cfg: dict, attention: str = "auto", timeout_s: float = 600.0
             ) -> list[StageEstimate]:
    """Per-stage estimates of a validated config (a plain dict with ``cluster``, ``model``,
    ``train``), measured in a helper process. ``attention``: ``auto`` (what each stage runs),
    ``flash`` or ``local`` for every stage. A MoE model's experts are routed evenly
    (:class:`ldt.memory.fake.BalancedRouting`)."""
    # named: the fake-tensor stack (torch, megatron-core) loads in the helper process only
    return local.run_local_world(1, "ldt.memory.stages:estimate_worker", (cfg, attention),
                                 timeout_s=timeout_s,
                           init_dist=False)[0]


def needs_estimate(cfg: dict) -> bool:
    """``train.estimate_memory``, or (unset) whether some stage states its memory."""
    asked = cfg["train"].get("estimate_memory")
    if asked is not None:
        return bool(asked)
    return any(st.get("memory_gib") is not None for st in cfg["cluster"]["stages"])
