"""Cost model: FLOPs, time, memory and transfer cost of pipeline pieces on a device kind.

Everything the planner and the simulator need to price a plan comes from here, so the
assumptions live in one place (and in ``docs/planner.md``); a stage's memory
(:mod:`ldt.plan.memory_cost`) and what a MoE layer adds (:mod:`ldt.plan.moe_cost`) have files
of their own, which take this model's shape:

* FLOPs per decoder layer and micro-batch (b sequences of length s, hidden h, ffn f, heads a,
  query groups g): QKV ``2bsh(h + 2hg/a)`` + output projection ``2bsh^2`` + MLP ``2bsh*f1 +
  2bsfh`` (fc1 is f wide, or 2f with a gated MLP: SwiGLU's gate and up) + attention core
  ``4bs^2h``; with g = a, f = 4h, no gate this is the textbook ``24bsh^2 + 4bs^2h``. Output
  head ``2bshV``; embedding lookup ~0. Backward = 2x.
* Time on kind K with TP t: ``flops / (t * peak * mfu * tp_efficiency**log2 t)`` plus the TP
  all-reduces (2 per layer forward, 2 backward, of ``b*s*h`` elements) priced as a ring,
  ``2(t-1)/t * bytes / intra_bw``. With sequence parallelism (``model.sequence_parallel``) on
  a stage of TP t > 1 they become an all-gather plus a reduce-scatter of the same volume: same
  time. Recomputation adds the recomputed forward to the backward.
* Parameters per rank follow the family: biases only where the model has them
  (``add_bias_linear``, ``add_qkv_bias``), LayerNorm weight + bias or RMSNorm weight, a position
  table only for learned absolute positions. Memory per rank (weights, fp32 gradients and Adam
  state per parameter; activations part by part; recomputation): :mod:`ldt.plan.memory_cost`.
* Attention with an explicit head size d (``model.kv_channels``, Qwen3) uses ``a*d`` in place of
  ``h`` for the queries, the output projection's input and the attention core.
* Mixture of experts (``model.num_moe_experts``, read by :func:`moe_shape`): a MoE layer's MLP
  costs what one token activates, its weights are all E experts, its token dispatch takes the
  place of the dense MLP's TP collectives (:func:`moe_dispatch_time`); a chunk is priced by the
  MoE layers it holds (:attr:`ChunkLoad.moe_layers`): :mod:`ldt.plan.moe_cost`.
* A stage boundary carries ``b*s*h`` elements: ``bytes / link_bw + latency``, plus a device->host
  and host->device copy where the device types differ (host-staged gloo), plus the receiving
  stage's TP broadcast (the leader receives and broadcasts, see DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Optional

import ldt.plan.memory_cost as memory_cost
from ldt.config import ModelConfig
from ldt.config.model import fused_attention
from ldt.plan.inventory import DTYPE_BYTES, DeviceKind, Inventory
from ldt.plan.memory_cost import GRAD_BYTES, Memory, Recompute
from ldt.plan.moe_cost import MoEShape, mix, moe_layer_params, moe_mlp_flops
from ldt.topology.device import plan_boundary
from ldt.topology.transport import FANOUT, carry, fanout_boundary

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class ChunkLoad:
    """What one model chunk on a stage holds: layers, E / L, and micro-batches in flight."""

    layers: int
    embedding: bool = False
    head: bool = False
    inflight: int = 1
    recompute: Optional[Recompute] = None
    """This chunk's stage's recomputation (None: none)."""
    moe_layers: Optional[int] = None
    """How many of its decoder layers are MoE layers (:meth:`CostModel.moe_count` of where
    it sits); None: not known, its layers priced at the model's average (one that mixes
    dense and MoE layers, ``model.moe_layer_freq``), or every layer is alike."""


def message_time(nbytes: float, link) -> float:
    """One message of ``nbytes`` over an inventory link: bytes / bandwidth + latency."""
    return nbytes / (link.bandwidth_gbps * GB) + link.latency_us * 1e-6


def ring_allreduce_time(nbytes: float, n: int, bw_gbps: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: each link moves 2(n-1)/n of the data."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / (bw_gbps * GB)


class CostModel:
    """Prices layers, chunks and boundaries of one model/workload on an inventory's kinds."""

    def __init__(self, model: ModelConfig, inventory: Inventory, micro_batch_size: int,
                 dtype: str | None = None, flash_attention: bool | None = None,
                 recompute: bool = False) -> None:
        self.model, self.inventory, self.b = model, inventory, micro_batch_size
        self.dtype = dtype or model.params_dtype
        self.d = DTYPE_BYTES[self.dtype]
        self.flash_attention = flash_attention
        """True / False: price fused (flash) or local attention on every stage; None: each
        stage as training runs it there (:func:`ldt.config.model.fused_attention` of its
        kind's device: flash on cuda, local on npu and cpu), as the memory estimate does."""
        self.recompute = recompute
        """Whether plans may recompute activations on stages that would not fit otherwise."""
        m = model
        self.h, self.a, self.s, self.V = m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size
        self.f = m.ffn_hidden_size or 4 * m.hidden_size
        self.g = m.num_query_groups or m.num_attention_heads
        self.hd = self.a * (m.kv_channels or self.h // self.a)  # width of all heads
        self.qkv = self.hd + 2 * self.hd * self.g // self.a  # QKV output width
        self.fc1 = 2 * self.f if m.gated_linear_unit else self.f  # fc1 output width
        self.norm = 2 * self.h if m.normalization == "LayerNorm" else self.h  # one norm's params
        self.sequence_parallel = bool(getattr(m, "sequence_parallel", False))
        self.moe = moe_shape(m)
        self.moe_at = tuple(m.moe_layers()) if self.moe and 0 < self.moe.share < 1 else ()
        """Per decoder layer, whether it is a MoE layer, where the model mixes dense and MoE
        layers; empty where every layer is priced alike."""
        self._boundary_times: dict[tuple[str, str, int, int], float] = {}  # the planner asks ~40k
        self._memories: dict[tuple, Memory] = {}  # and ~28k stage memories, a few hundred distinct
        self._cache: dict[tuple, tuple[float, float]] = {}
        self.memo: dict[tuple, object] = {}
        """What callers derive from these prices and ask again (ldt.plan.evaluate's per-stage
        terms); a key starts with the caller's tag."""

    # ---- which layers are MoE layers ----------------------------------------------------------
    def moe_count(self, first: int, layers: int) -> Optional[int]:
        """How many of the decoder layers ``first`` to ``first + layers - 1`` are MoE layers
        (:attr:`ChunkLoad.moe_layers`); None where every layer is priced alike."""
        return sum(self.moe_at[first:first + layers]) if self.moe_at else None

    def moe_share(self, chunk: Optional[ChunkLoad] = None) -> float:
        """The fraction of MoE layers among ``chunk``'s decoder layers, or where it does not
        say (or no chunk is given) among the model's; 0.0 for a dense model."""
        if chunk is None or chunk.moe_layers is None or chunk.layers == 0:
            return self.moe.share if self.moe is not None else 0.0
        return chunk.moe_layers / chunk.layers

    def holds_moe(self, chunks: list[ChunkLoad]) -> bool:
        """Whether a stage of these chunks holds a MoE layer (where selective ``moe``
        recomputation applies)."""
        return self.moe is not None and any(c.layers and self.moe_share(c) > 0 for c in chunks)

    def layer_share(self, share: Optional[float]) -> float:
        """A per-layer price's ``share``: as given, or the model's."""
        return self.moe_share() if share is None else share

    # ---- FLOPs (forward, one micro-batch) ---------------------------------------------------
    def layer_flops(self, share: Optional[float] = None) -> float:
        """One decoder layer's forward, one micro-batch: a dense layer's (``share`` 0.0), a
        MoE layer's (1.0), or the average of layers of which ``share`` are MoE layers
        (:meth:`moe_share`; None: the model's). The per-layer prices below take it alike."""
        b, s, h = self.b, self.s, self.h
        mlp = 2 * b * s * h * self.fc1 + 2 * b * s * self.f * h
        if self.moe is not None:
            mlp = mix(mlp, moe_mlp_flops(self.moe, b, s, h), self.layer_share(share))
        return 2 * b * s * h * self.qkv + 2 * b * s * self.hd * h + mlp + 4 * b * s * s * self.hd

    def layer_linear_flops(self, share: Optional[float] = None) -> float:
        """The part of :meth:`layer_flops` in megatron's column- and row-parallel linear layers
        (QKV, projection, the MLP's or the active experts' fc1 and fc2): what their weight
        gradient costs again in the backward, the W of a zero-bubble schedule (the attention
        core has no weights; a MoE router's is not split, ``patches/wgrad_split.py``)."""
        b, s, h = self.b, self.s, self.h
        share = self.layer_share(share)
        out = self.layer_flops(share) - 4 * b * s * s * self.hd
        return out - (share * 2 * b * s * h * self.moe.experts if self.moe else 0.0)

    def head_flops(self) -> float:
        return 2 * self.b * self.s * self.h * self.V

    # ---- parameters per rank ----------------------------------------------------------------
    def layer_params(self, tp: int, share: Optional[float] = None) -> float:
        """Column-parallel (QKV, fc1: weight + bias) and row-parallel weights split over TP;
        row-parallel biases and the two norms are replicated; ``share``: :meth:`layer_flops`'."""
        h, f, q, f1, m = self.h, self.f, self.qkv, self.fc1, self.model
        bias = m.add_bias_linear
        split = h * q + self.hd * h + h * f1 + f * h
        split += (q if bias or m.add_qkv_bias else 0) + (f1 if bias else 0)
        qk_norms = 2 * self.norm * self.hd // self.a // h if m.qk_layernorm else 0
        out = split / tp + (2 * h if bias else 0) + 2 * self.norm + qk_norms
        if self.moe is None:
            return out
        return moe_layer_params(self, out, tp, self.layer_share(share))

    def embedding_params(self, tp: int) -> float:
        pos = self.model.max_position_embeddings or self.s
        table = pos * self.h if self.model.position_embedding_type == "learned_absolute" else 0
        return self.V * self.h / tp + table

    def head_params(self, tp: int, shares_embedding: bool = False) -> float:
        out = 0.0 if shares_embedding else self.V * self.h / tp
        return out + self.norm  # + final norm

    def chunk_params(self, tp: int, chunk: ChunkLoad, shares_embedding: bool = False) -> float:
        p = chunk.layers * self.layer_params(tp, self.moe_share(chunk))
        if chunk.embedding:
            p += self.embedding_params(tp)
        if chunk.head:
            p += self.head_params(tp, shares_embedding)
        return p

    # ---- memory per rank (bytes): ldt.plan.memory_cost -------------------------------------------
    def sequence_shards(self, tp: int) -> int:
        """Over how many ranks the sequence outside attention and the MLP is split."""
        return tp if self.sequence_parallel and tp > 1 else 1

    def flash(self, kind: str) -> bool:
        """Whether a stage of ``kind`` runs fused (flash) attention (:attr:`flash_attention`)."""
        if self.flash_attention is not None:
            return self.flash_attention
        return fused_attention(self.model, self.inventory.kind(kind).device)

    def layer_parts(self, kind: str, tp: int, share: Optional[float] = None
                    ) -> dict[str, float]:
        """:func:`ldt.plan.memory_cost.layer_parts`: one decoder layer's bytes per token."""
        return memory_cost.layer_parts(self, kind, tp, share)

    def layer_activation_bytes(self, kind: str, tp: int, recompute=None,
                               share: Optional[float] = None) -> float:
        """:func:`ldt.plan.memory_cost.layer_activation_bytes`: one layer, one micro-batch."""
        return memory_cost.layer_activation_bytes(self, kind, tp, recompute, share)

    def decoder_activation_bytes(self, kind: str, tp: int, layers: int, recompute=None,
                                 share: Optional[float] = None) -> float:
        """:func:`ldt.plan.memory_cost.decoder_activation_bytes`: a chunk's decoder layers."""
        return memory_cost.decoder_activation_bytes(self, kind, tp, layers, recompute, share)

    def recompute_transient(self, kind: str, tp: int, chunk: ChunkLoad) -> float:
        """:func:`ldt.plan.memory_cost.recompute_transient`: what recomputation rebuilds."""
        return memory_cost.recompute_transient(self, kind, tp, chunk)

    def stage_memory(self, kind: str, tp: int, chunks: list[ChunkLoad], recv_buffers: int = 0
                     ) -> Memory:
        """:func:`ldt.plan.memory_cost.stage_memory`, remembered: the planner asks for ~28k
        stage memories, a few hundred distinct."""
        key = (self.flash(kind), tp, tuple(chunks), recv_buffers)
        if key not in self._memories:
            self._memories[key] = memory_cost.stage_memory(self, kind, tp, chunks, recv_buffers)
        return self._memories[key]

    def memory_limit(self, kind: str) -> float:
        k = self.inventory.kind(kind)
        return (k.memory_gib - k.reserved_gib) * GIB

    # ---- time (seconds) ------------------------------------------------------------------------
    def _speed(self, k: DeviceKind, tp: int) -> float:
        """Achieved FLOP/s of one TP group."""
        return tp * k.tflops * 1e12 * k.mfu * k.tp_efficiency ** math.log2(tp)

    def _tp_allreduce(self, k: DeviceKind, tp: int) -> float:
        return ring_allreduce_time(self.b * self.s * self.h * self.d, tp, k.intra_bw_gbps)

    def layer_time(self, kind: str, tp: int, share: Optional[float] = None
                   ) -> tuple[float, float]:
        """(forward, backward) seconds of one decoder layer for one micro-batch; ``share``:
        :meth:`layer_flops`'."""
        share = self.layer_share(share)
        key = ("layer", kind, tp, share)
        if key not in self._cache:
            k = self.inventory.kind(kind)
            fwd = self.layer_flops(share) / self._speed(k, tp)
            mlp_comm = self._tp_allreduce(k, tp) if self.moe is None else \
                mix(self._tp_allreduce(k, tp), moe_dispatch_time(self, k, tp), share)
            ar = self._tp_allreduce(k, tp) + mlp_comm
            self._cache[key] = (fwd + ar, 2 * fwd + ar)
        return self._cache[key]

    def embedding_time(self, kind: str, tp: int) -> tuple[float, float]:
        """Lookup is free; the vocab-parallel embedding all-reduces its output once."""
        return self._tp_allreduce(self.inventory.kind(kind), tp), 0.0

    def head_time(self, kind: str, tp: int) -> tuple[float, float]:
        """Output head matmul (+ loss); backward all-reduces the head's input gradient."""
        k = self.inventory.kind(kind)
        fwd = self.head_flops() / self._speed(k, tp)
        return fwd, 2 * fwd + self._tp_allreduce(k, tp)

    def recompute_time(self, kind: str, tp: int, layers: int, recompute,
                       share: Optional[float] = None) -> float:
        """The forward a chunk's recomputation repeats during its backward, seconds: every
        recomputed layer (full), or the recomputed modules' FLOPs (selective: the attention
        core's ``4bs^2h``, the dense layers' MLP, the MoE layers' MLP with its token dispatch
        again; the norms are negligible). ``share``: of the chunk's layers, as
        :meth:`layer_flops`'."""
        share = self.layer_share(share)
        granularity = getattr(recompute, "granularity", None)
        if granularity == "full":
            n = layers if recompute.method == "uniform" else min(recompute.num_layers, layers)
            return n * self.layer_time(kind, tp, share)[0]
        b, s, h = self.b, self.s, self.h
        k = self.inventory.kind(kind)
        modules = memory_cost.selective_modules(recompute)
        flops = {"core_attn": 4 * b * s * s * h,
                 "mlp": (1.0 - share) * (2 * b * s * h * self.fc1 + 2 * b * s * self.f * h)}
        comm = 0.0
        if self.moe is not None and "moe" in modules:
            flops["moe"] = share * moe_mlp_flops(self.moe, b, s, h)
            comm = share * moe_dispatch_time(self, k, tp)
        per_layer = sum(flops.get(m, 0.0) for m in modules) / self._speed(k, tp) + comm
        return layers * per_layer

    def chunk_time(self, kind: str, tp: int, chunk: ChunkLoad) -> tuple[float, float]:
        share = self.moe_share(chunk)
        lf, lb = self.layer_time(kind, tp, share)
        f, b = chunk.layers * lf, chunk.layers * lb
        if chunk.recompute is not None:
            b += self.recompute_time(kind, tp, chunk.layers, chunk.recompute, share)
        if chunk.embedding:
            ef, eb = self.embedding_time(kind, tp)
            f, b = f + ef, b + eb
        if chunk.head:
            hf, hb = self.head_time(kind, tp)
            f, b = f + hf, b + hb
        return f, b

    def wgrad_time(self, kind: str, tp: int, chunk: ChunkLoad) -> float:
        """The part of :meth:`chunk_time`'s backward that is the weight gradient of the
        chunk's linear layers (the head's too): a zero-bubble schedule's W, one micro-batch;
        its B is the rest (input gradients, TP collectives, recomputation)."""
        flops = chunk.layers * self.layer_linear_flops(self.moe_share(chunk))
        if chunk.head:
            flops += self.head_flops()
        return flops / self._speed(self.inventory.kind(kind), tp)

    def wstore_bytes(self, tp: int, chunk: ChunkLoad) -> float:
        """One micro-batch's W store entry on a rank (a zero-bubble schedule holds it from
        the chunk's B to its W): what each split linear layer's weight gradient needs, its
        input (whole: with sequence parallelism the gathered copy) and its output gradient.
        Per layer QKV ``h`` and ``qkv/t``, the projection ``hd/t`` and ``h``, fc1 ``h`` and
        ``fc1/t``, fc2 ``f/t`` and ``h`` (a MoE layer's ``topk`` expert MLPs in place of the
        MLP's); the head ``h`` and ``V/t``; per token, in the activations' dtype."""
        h, t, e = self.h, tp, self.moe
        mlp = h + self.fc1 / t + self.f / t + h
        if e is not None:
            mlp = mix(mlp, e.topk * (h + (e.fc1 + e.ffn) / t + h), self.moe_share(chunk))
        per_token = chunk.layers * (h + self.qkv / t + self.hd / t + h + mlp)
        if chunk.head:
            per_token += h + self.V / t
        return self.s * self.b * self.d * per_token

    def wgrad_transient(self, tp: int, chunk: ChunkLoad) -> float:
        """A zero-bubble W's own peak on a rank: the largest of the chunk's split linear
        layers' weight gradients, in the weights' dtype. W makes one weight's gradient at a
        time and autograd hands it to DDP's hook, which adds it to ``main_grad`` and drops it,
        before the next (``patches/wgrad_split.run_wgrad``; the estimator on megatron's
        layers: llama_tiny h 256, TP 1 / 2, bf16, the head's chunk, to W's graph's two
        scalars). A MoE chunk's largest is taken from the dense layer's shapes: an
        overestimate where its experts' weights are smaller, not checked on a MoE model."""
        h, t = self.h, tp
        largest = max(h * self.qkv, self.hd * h, h * self.fc1, self.f * h) / t \
            if chunk.layers else 0.0
        if chunk.head:
            largest = max(largest, self.V * h / t)
        return self.d * largest

    def boundary_bytes(self) -> float:
        return self.b * self.s * self.h * self.d

    def boundary_time(self, src_kind: str, dst_kind: str, dst_tp: int, src_tp: int = 1,
                      per_stage_dp: bool = False) -> float:
        """One activation (or gradient) from a stage of TP ``src_tp`` to the next stage, all its
        ``dst_tp`` ranks, as ``cluster.boundary_fanout=auto`` moves it between nodes (the route
        policy a run uses, :func:`ldt.topology.transport.carry`; the planner places stages on
        separate nodes): a small message as a copy per TP rank, which the sending ranks share
        unless the sequence is sharded over them, a larger one, or any message of a plan with
        per-stage DP (``per_stage_dp``: no fan-out there), as one copy whose last piece the
        receiving leader relays."""
        key = (src_kind, dst_kind, dst_tp, src_tp, per_stage_dp)
        if key in self._boundary_times:
            return self._boundary_times[key]
        nbytes = self.boundary_bytes()
        src, dst = self.inventory.kind(src_kind), self.inventory.kind(dst_kind)
        link = self.inventory.link(src_kind, dst_kind)
        whole_senders = 1 if self.sequence_parallel else src_tp  # fanout_sources' rule
        how = carry(nbytes, dst_tp, mode="auto", same_node=False, senders=whole_senders,
                    fanout_group=fanout_boundary("auto", src_tp, dst_tp, per_stage_dp))
        t = message_time(how.copies * nbytes, link)
        if plan_boundary(0, src.device, 1, dst.device).host_staged:  # the run's own rule
            t += sum(nbytes / (k.host_bw_gbps * GB) for k in (src, dst) if k.device != "cpu")
        if dst_tp > 1 and how.kind != FANOUT:  # the relay of the last piece in the TP group
            t += nbytes / how.pieces / (dst.intra_bw_gbps * GB)
        self._boundary_times[key] = t
        return t

    def dp_allreduce_time(self, kind: str, params_per_rank: float, dp: int) -> float:
        """Gradient all-reduce across replicas (not overlapped with the pipeline: conservative),
        in fp32 whatever the dtype: megatron's DDP reduces the fp32 gradient buffer
        (``grad_reduce_in_fp32`` with fp32 main params, ldt.training.optim)."""
        return ring_allreduce_time(params_per_rank * GRAD_BYTES, dp,
                                   self.inventory.link(kind, kind).bandwidth_gbps)


# ---- mixture of experts: the model's experts and a MoE layer's collectives --------------------
def moe_shape(model: ModelConfig) -> MoEShape | None:
    """The model's experts, read from its config here: the rest of a MoE layer's price
    (:mod:`ldt.plan.moe_cost`) is computed from them and the cost model's shape."""
    if not model.num_moe_experts:
        return None
    fm = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    layers = model.moe_layers()
    return MoEShape(model.num_moe_experts, model.moe_router_topk, fm,
                    2 * fm if model.gated_linear_unit else fm, sum(layers) / len(layers))


def moe_dispatch_time(cost: CostModel, k: DeviceKind, tp: int) -> float:
    """A MoE layer's MLP communication per direction: its token dispatch all-gathers the
    stage's ``b*s*h`` tokens over its TP group and reduce-scatters the expert outputs
    (megatron's all-gather dispatcher), where a dense layer all-reduces."""
    return ring_allreduce_time(cost.b * cost.s * cost.h * cost.d, tp, k.intra_bw_gbps)
