"""One stage's memory, counted on its real chunks and optimizer built from fake tensors.

Inside :func:`ldt.memory.fake.fake_rank` the stage is built by the code that trains it
(:func:`ldt.training.stage.build_stage_models`, :func:`ldt.training.optim.build_stage_optimizer`:
megatron-core's GPTModel chunks with the stage's TP, sequence parallelism and recomputation,
its DDP buffers and optimizer) and then:

- the resident part is read off those objects, each storage once, in this order: weights
  (parameters and buffers; with the distributed optimizer megatron's parameter buffer they
  live in), gradients (DDP's grad buffers, buckets and padding included), fp32 main
  parameters (the optimizer's own copies, this rank's shard), optimizer states (created by one
  step of the optimizer megatron built, this rank's shard);
- two micro-batches run forward, then backward, through each chunk, as the schedule calls it,
  under torch's MemTracker: what the second forward leaves alive (everything saved for
  backward, the chunk's input and output) is the chunk's activations per micro-batch, and the
  highest point above the two during forward and backward (recomputed activations, gradients
  of activations, workspaces, and what the first micro-batch made once per process) its
  transient;
- the optimizer step's transient above the resident part (e.g. foreach Adam's temporaries).

Attention: what a stage runs there decides the largest activation at long sequences. A cuda
stage runs Transformer Engine's fused attention (``transformer_impl: auto``; assumed present on
the cuda hosts, absent on this machine): it keeps no ``s x s`` scores, which the estimate
reproduces with a stand-in for megatron's local core attention that keeps what flash
attention keeps (:class:`FlashAttention`). npu and cpu stages run megatron's
local attention (ldt's layer spec there), scores and softmax kept, and the estimate counts
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass

import torch
from megatron.core.utils import get_attr_wrapped_model
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker

from ldt import patches
from ldt.config.model import fused_attention
from ldt.models.build import DTYPES
from ldt.patches.wgrad_split import deferring, run_wgrad
from ldt.training.flat_state import part_bytes
from ldt.training.optim import RUN_STATE_KEYS, build_stage_optimizer
from ldt.training.snapshot import taken_state
from ldt.training.stage import build_stage_models, make_forward_step


@dataclass
class ChunkMemory:
    activations: int
    """Bytes one micro-batch leaves alive after the chunk's forward."""
    transient: int
    """Bytes above that at the highest point of the micro-batch's forward and backward."""
    once: int = 0
    """Of the transient, what the process makes once and keeps (megatron's global buffer for
    local attention's scores, the causal mask): made by whichever chunk runs first, it is
    there during every chunk's micro-batches."""
    wstore: int = 0
    """``train.schedule=zb``: bytes one micro-batch leaves in the W store after its B (the
    split linear layers' inputs and output gradients) until its W; 0 otherwise."""
    wgrad_transient: int = 0
    """``train.schedule=zb``: the peak of one W above what was there before it (its entry
    included there): the chunk's largest weight gradient (W makes one at a time; DDP's hook
    adds each to ``main_grad`` and drops it before the next is made)."""


@dataclass
class StageMeasure:
    weights: int
    grads: int
    main_params: int
    optimizer: int
    chunks: list[ChunkMemory]
    step_transient: int
    boundary_tensor: int
    """Bytes of one tensor crossing this stage's boundary (a receive buffer)."""
    attention: str
    """``flash`` or ``local`` (see the module docstring)."""
    snapshot: int = 0
    """Bytes of one snapshot part of this rank's state, in files (``train.snapshot_dir``)."""


class _NoModules:
    """Stands in for MemTracker's ModTracker: no module hooks, never "in backward"."""

    is_bw = False
    parents: set = set()

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class LivePeak(MemTracker):
    """torch's MemTracker reduced to what the estimate needs: the bytes of every tensor
    storage alive in the process (fake or real), and their peak since :meth:`reset_peak`.

    Its module tracker is left out (measured here): its per-module peaks cost modules x ops (a
    16-layer qwen2.5_32b chunk's backward: 13.6 s with them, 2.4 s without); its backward
    hooks keep the gradients of every module's inputs alive until the step ends (a real
    pipeline rank then "holds" 128 KiB more per micro-batch of gpt_tiny, growing with the
    micro-batch count); it refuses a module called twice from the top level (a pipeline chunk
    runs once per micro-batch) and calls ``module.buffers()``, which megatron's
    DistributedDataParallel replaces with a list. Storages are still tracked by MemTracker
    itself (creation through the dispatcher, release through weak references,
    ``track_external`` for what existed before)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModules()

    def _update_peak_stats(self, peak_state) -> None:
        total = self.current()
        if total > self._peak_mem.get("all", 0):
            self._peak_mem["all"] = total

    def current(self) -> int:
        """Bytes alive now."""
        return sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values())

    def reset_peak(self) -> int:
        self._peak_mem = {"all": self.current()}
        return self._peak_mem["all"]

    def set_peak(self, value: int) -> None:
        """Put back a peak taken before (what ran since is counted elsewhere)."""
        self._peak_mem = {"all": max(value, self.current())}

    def peak(self) -> int:
        return max(self._peak_mem.get("all", 0), self.current())


def attention_of(model, device: str, attention: str = "auto") -> str:
    """``flash`` where the stage runs fused attention (cuda: Transformer Engine), else
    ``local``; ``attention`` forces one for every stage."""
    if attention != "auto":
        return attention
    return "flash" if fused_attention(model, device) else "local"


def measure_stage(c, topo, state, device: str, attention: str = "auto") -> StageMeasure:
    """Build this rank's stage under fake tensors and count it (see the module docstring)."""
    attn = attention_of(c.model, device, attention)
    dtype = DTYPES[c.model.params_dtype]
    models = _stage_models(c, topo, state, attn, dtype)
    shared = len({id(p) for g in models for p in g.parameters()}) < \
        sum(1 for g in models for _ in g.parameters())
    opt = build_stage_optimizer(c, topo, state, models, shared_chunks=shared)
    inner = _inner_optimizers(opt.optimizer)

    seen: dict = {}
    # with the distributed optimizer the parameters are views of megatron's parameter buffer:
    # their storages are that buffer, counted here whole (padding included)
    weights = _new_bytes(seen, [t for g in models for t in (*g.parameters(), *g.buffers())])
    grads = _new_bytes(seen, [b.grad_data for d in opt.ddp for b in _ddp_buffers(d)])
    main_params = _new_bytes(seen, [p for o in inner for g in o.param_groups
                                    for p in g["params"]])

    batch = _MicroBatch.of(c, topo, state, dtype)
    # gloo's reduce-scatter (a cpu stage with sequence parallelism: megatron's linear
    # backward) returns a slice of a whole [s, b, h] copy it keeps until the wait returns;
    # the fake process group makes no copy (measured: cpu_vtp's last stage at TP 2, 32 KiB)
    gloo_copy = batch.boundary_bytes if device == "cpu" and batch.sp > 1 else 0
    tracker = LivePeak()
    # Everything counted above is known to the tracker before anything runs: a storage it has
    # not seen counts as new when an operation first touches it, so DDP's gradient hooks
    # (``main_grad.add_``, a view of the grad buffer) put the whole grad buffer into the
    # backward's transient (4 bytes per parameter counted twice, measured: cpu_vtp s1 399872
    # bytes, +10% of its peak) and the step would count the main parameters as states.
    tracker.track_external(*models, *_storages_of(seen))
    chunks = topo.split.stage_chunks(state.stage)
    last: list = []  # see _measure_chunk
    split = c.train.schedule == "zb"  # B and W apart, as the run splits them
    applied = patches.apply(["wgrad_split"]) if split else []
    try:
        with tracker:
            measured = [_measure_chunk(tracker, batch, chunk, run, gloo_copy, last, split)
                        for chunk, run in zip(chunks, opt.chunks)]
            optimizer, step_transient = _measure_step(tracker, inner, device)
    finally:
        patches.revert(applied)
    # the part a snapshot writes: the state the run takes, as the run lays it out (its
    # counters by key only: the loss scale's are fp16's)
    snapshot = part_bytes(taken_state(models, chunks, opt, 0, dict.fromkeys(RUN_STATE_KEYS, 0)))
    return StageMeasure(weights, grads, main_params, optimizer, measured, step_transient,
                        batch.boundary_bytes, attn, snapshot)


def _stage_models(c, topo, state, attn: str, dtype: torch.dtype) -> list:
    """The stage's chunks as training builds them, with flash attention's memory where the
    stage runs it, in the model's dtype."""
    models = build_stage_models(c, topo, state)
    if attn == "flash":
        for gpt in models:
            for layer in gpt.decoder.layers:
                layer.self_attention.core_attention = FlashAttention()
    for gpt in models:  # Float16Module's cast, done here: Module._apply cannot swap fake
        if dtype != torch.float32:  # parameters (ldt.memory.fake); the position table and
            for t in (*gpt.parameters(), *gpt.buffers()):  # RoPE buffers are made in fp32
                if t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
        gpt.bfloat16 = gpt.half = (lambda g=gpt: g)
    return models


@dataclass
class _MicroBatch:
    """One micro-batch of the stage: its sizes, and the forward step that trains it (its causal
    mask is made once, by the first forward)."""

    b: int
    s: int
    h: int
    sp: int  # sequence-parallel shards of a boundary tensor
    dtype: torch.dtype
    step_func: list = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, c, topo, state, dtype: torch.dtype) -> "_MicroBatch":
        m, tp = c.model, topo.stages[state.stage].tp
        sp = 1 if not (m.sequence_parallel and tp > 1) else tp
        return cls(c.train.micro_batch_size, m.seq_length, m.hidden_size, sp, dtype)

    @property
    def boundary_bytes(self) -> int:
        """Bytes of one whole ``[s, b, h]`` boundary tensor."""
        return self.s * self.b * self.h * self.dtype.itemsize

    def forward(self, chunk, run) -> tuple:
        """(input, loss or output, batch) of one forward through ``run``."""
        b, s = self.b, self.s
        if not self.step_func:
            self.step_func.append(make_forward_step(s))
        batch = None
        if chunk.has_embedding or chunk.has_head:  # what a data stage's batch holds
            tokens = torch.zeros(b, s, dtype=torch.long)  # (ldt.data.bytes), per micro-batch
            batch = {"tokens": tokens, "labels": tokens.clone(),
                     "loss_mask": torch.ones(b, s),
                     "position_ids": torch.arange(s).repeat(b, 1)}
        inp = None
        if not chunk.has_embedding:
            inp = torch.zeros(s // self.sp, b, self.h, dtype=self.dtype, requires_grad=True)
        get_attr_wrapped_model(run, "set_input_tensor")(inp)
        out, loss = self.step_func[0](iter([batch]) if batch else None, run)
        # the batch lives with its micro-batch: ldt's runtime keeps it from the start
        # chunk's forward to the end chunk's (labels, loss mask: 4.6 KiB over cpu_vdp's
        # edge); megatron's keeps less, a few bytes per token
        return inp, loss(out)[0] if chunk.has_head else out, batch


def _measure_chunk(tracker: LivePeak, batch: _MicroBatch, chunk, run, gloo_copy: int,
                   last: list, split: bool = False) -> ChunkMemory:
    """Two micro-batches through one chunk, the second run while the first is alive: the
    first also makes what a process makes once (megatron's global buffer for local
    attention's scores: b*a/tp*s*s*4 bytes, 64 KiB on a TP 2 gpt_tiny rank), so the second
    says what each micro-batch in flight keeps, and the once-made part goes to the
    transient.

    ``last`` holds the first micro-batch's output and batch from here until the next chunk's
    backward and through the optimizer step: the measure has always counted them so, and the
    recorded figures (bench/results/memory.json) were measured that way (without it a
    two-chunk edge's transient changes: 5800 -> 5832 bytes on test_memory_measure's MOE).

    ``split`` (``train.schedule=zb``, the ``wgrad_split`` patch applied): each backward is a
    B with the weight gradients deferred, then its W; what the W frees is the W store's
    entry of one micro-batch (:attr:`ChunkMemory.wstore`), and W's own peak (the largest
    weight gradient: W makes them one at a time) is its own transient,
    :attr:`ChunkMemory.wgrad_transient`, not the forward's and B's."""
    base = tracker.reset_peak()
    first = batch.forward(chunk, run)
    mid = tracker.current()
    second = batch.forward(chunk, run)
    held = tracker.current() - mid
    wstore = wgrad = 0
    for _, out, data in (second, first):  # as a pipeline does: the last forward first
        last[:] = (out, data)
        works: list = []
        with deferring(works.append) if split else contextlib.nullcontext():
            out.backward(torch.ones_like(out))
        if works:  # W, right after its B
            so_far, before = tracker.peak(), tracker.reset_peak()
            run_wgrad(works)
            wgrad = max(wgrad, tracker.peak() - before)
            del works[:]
            gc.collect()
            wstore = max(wstore, before - tracker.current())
            tracker.set_peak(so_far)
    peak = tracker.peak() - base
    del first, second
    gc.collect()
    return ChunkMemory(held, max(peak - 2 * held, 0) + gloo_copy,
                       max(tracker.current() - base, 0), wstore, wgrad)


def _measure_step(tracker: LivePeak, inner: list, device: str) -> tuple[int, int]:
    """(optimizer states, the step's transient): one step of each torch optimizer."""
    for o in inner:  # the gradients megatron hands its optimizer are views of DDP's buffer
        for g in o.param_groups:
            g["foreach"] = device != "cpu"  # torch's default off CPU
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
    base = tracker.reset_peak()
    for o in inner:
        o.step()
    return tracker.current() - base, tracker.peak() - tracker.current()


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers megatron's (chained) optimizer steps."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chained]


def _ddp_buffers(ddp) -> list:
    return [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]


def _storages_of(seen: dict) -> list:
    """One tensor over each storage in ``seen`` (what :meth:`MemTracker.track_external` takes)."""
    return [torch.empty(0, dtype=torch.uint8, device=st.device).set_(st) for st in seen]


def _new_bytes(seen: dict, tensors) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (which then holds them too)."""
    total = 0
    for t in tensors:
        for st in get_untyped_storages(t):
            if st not in seen:
                seen[st] = True
                total += st.nbytes()
    return total


class _FlashMemory(torch.autograd.Function):
    """What fused (flash) attention keeps for backward: q, k, v, its output and the log-sum-
    exp per query and head, nothing of ``s x s``; its backward makes dq, dk, dv. It computes
    nothing: the estimate runs on fake tensors, where only shapes and storages exist."""

    @staticmethod
    def forward(ctx, q, k, v):
        s, b, heads, d = q.shape
        out = q.new_empty(s, b, heads * d)
        lse = q.new_empty(b, heads, s, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FlashAttention(torch.nn.Module):
    """Megatron's core-attention interface with the memory of Transformer Engine's fused
    attention (the estimate of cuda stages): ``[s, b, heads, d]`` in, ``[s, b, h / tp]`` out."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        return _FlashMemory.apply(query, key, value)


def cpu_topology(topo):
    """``topo`` with every stage on ``cpu``: the fake world builds every chunk on this machine
    (sizes do not depend on the device type)."""
    return dataclasses.replace(topo, stages=tuple(dataclasses.replace(st, device="cpu")
                                                  for st in topo.stages))
