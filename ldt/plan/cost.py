"""Cost model: FLOPs, time, memory and transfer cost of pipeline pieces on a device kind.

Everything the planner and the simulator need to price a plan comes from here, so the
assumptions live in one file (and in ``docs/planner.md``):

* FLOPs per decoder layer and micro-batch (b sequences of length s, hidden h, ffn f, heads a,
  query groups g): QKV ``2bsh(h + 2hg/a)`` + output projection ``2bsh^2`` + MLP ``2bsh*f1 +
  2bsfh`` (fc1 is f wide, or 2f with a gated MLP: SwiGLU's gate and up) + attention core
  ``4bs^2h``; with g = a, f = 4h, no gate this is the textbook ``24bsh^2 + 4bs^2h``. Output
  head ``2bshV``; embedding lookup ~0. Backward = 2x.
* Time on kind K with TP t: ``flops / (t * peak * mfu * tp_efficiency**log2 t)`` plus the TP
  all-reduces (2 per layer forward, 2 backward, of ``b*s*h`` elements) priced as a ring,
  ``2(t-1)/t * bytes / intra_bw``.
* Memory per rank: weights (dtype) + gradients (dtype) + Adam state; 16-bit training keeps an fp32
  master copy and m, v (12 bytes/param), fp32 training keeps m, v (8 bytes/param): 16 bytes/param
  either way. No distributed optimizer, no recomputation.
  Parameters follow the family: biases only where the model has them (``add_bias_linear``,
  ``add_qkv_bias``), LayerNorm weight + bias or RMSNorm weight, a position table only for
  learned absolute positions.
  Activations per layer (Korthikanti et al. 2022, generalised to any f and dtype d bytes):
  ``s*b*(d*(4h + (2h + 2hg/a + f1 + f)/t) + 2h)`` bytes (fc1's output f1 and fc2's input f;
  f1 = f without a gate, so 2f as in the paper), plus ``s*b*(2d+1)*a*s/t`` when attention
  scores are materialised (no flash attention); times the micro-batches a chunk holds in flight.
  With sequence parallelism (``model.sequence_parallel``) on a stage of TP t > 1 the part outside
  attention and the MLP (``d*4h + 2h``: the norms' inputs, the dropout masks) is split along the
  sequence too, so the whole layer is divided by t (the paper's ``sbh(34/t + 5as/(ht))``), as
  are the embedding's dropout mask and the head's norm and input; the logits stay ``4V/t``.
  The TP all-reduces become an all-gather plus a reduce-scatter of the same volume: same time.
* Attention with an explicit head size d (``model.kv_channels``, Qwen3) uses ``a*d`` in place of
  ``h`` for the queries, the output projection's input and the attention core.
* Mixture of experts (``model.num_moe_experts``; the functions at the end of this file): a MoE
  layer's MLP costs what one token activates, the router ``2bshE`` plus ``topk`` experts of
  width ``fm``; its weights are all E experts (``E * expert / tp`` per rank: the experts are
  split or spread over the stage's TP ranks whatever its ``ep``), its activations hold the
  ``topk`` dispatched copies of every token; its token dispatch (megatron's all-gather
  dispatcher: all-gather the stage's tokens, reduce-scatter the outputs over the TP group)
  takes the place of the dense MLP's TP collectives, with the same volume. A model with dense
  and MoE layers is priced per layer as their average (the planner splits layer counts).
* A stage boundary carries ``b*s*h`` elements: ``bytes / link_bw + latency``, plus a device->host
  and host->device copy where the device types differ (host-staged gloo), plus the receiving
  stage's TP broadcast (the leader receives and broadcasts, see DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ldt.config import ModelConfig
from ldt.plan.inventory import DTYPE_BYTES, DeviceKind, Inventory

GB = 1e9
GIB = 2**30
OPTIMIZER_BYTES = {2: 12, 4: 8}  # per param: fp32 master + m + v (16-bit) / m + v (fp32)


@dataclass(frozen=True)
class ChunkLoad:
    """What one model chunk on a stage holds: layers, E / L, and micro-batches in flight."""

    layers: int
    embedding: bool = False
    head: bool = False
    inflight: int = 1


@dataclass(frozen=True)
class Memory:
    """Per-rank memory of one stage, bytes."""

    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def ring_allreduce_time(nbytes: float, n: int, bw_gbps: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: each link moves 2(n-1)/n of the data."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / (bw_gbps * GB)


class CostModel:
    """Prices layers, chunks and boundaries of one model/workload on an inventory's kinds."""

    def __init__(self, model: ModelConfig, inventory: Inventory, micro_batch_size: int,
                 dtype: str | None = None, flash_attention: bool = True) -> None:
        self.model, self.inventory, self.b = model, inventory, micro_batch_size
        self.dtype = dtype or model.params_dtype
        self.d = DTYPE_BYTES[self.dtype]
        self.flash_attention = flash_attention
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
        self._cache: dict[tuple, tuple[float, float]] = {}

    # ---- FLOPs (forward, one micro-batch) ---------------------------------------------------
    def layer_flops(self) -> float:
        b, s, h = self.b, self.s, self.h
        mlp = 2 * b * s * h * self.fc1 + 2 * b * s * self.f * h
        if self.moe is not None:
            mlp = moe_mlp_flops(self, mlp)
        return 2 * b * s * h * self.qkv + 2 * b * s * self.hd * h + mlp + 4 * b * s * s * self.hd

    def head_flops(self) -> float:
        return 2 * self.b * self.s * self.h * self.V

    # ---- parameters per rank ----------------------------------------------------------------
    def layer_params(self, tp: int) -> float:
        """Column-parallel (QKV, fc1: weight + bias) and row-parallel weights split over TP;
        row-parallel biases and the two norms are replicated."""
        h, f, q, f1, m = self.h, self.f, self.qkv, self.fc1, self.model
        bias = m.add_bias_linear
        split = h * q + self.hd * h + h * f1 + f * h
        split += (q if bias or m.add_qkv_bias else 0) + (f1 if bias else 0)
        qk_norms = 2 * self.norm * self.hd // self.a // h if m.qk_layernorm else 0
        out = split / tp + (2 * h if bias else 0) + 2 * self.norm + qk_norms
        return out if self.moe is None else moe_layer_params(self, out, tp)

    def embedding_params(self, tp: int) -> float:
        pos = self.model.max_position_embeddings or self.s
        table = pos * self.h if self.model.position_embedding_type == "learned_absolute" else 0
        return self.V * self.h / tp + table

    def head_params(self, tp: int, shares_embedding: bool = False) -> float:
        out = 0.0 if shares_embedding else self.V * self.h / tp
        return out + self.norm  # + final norm

    def chunk_params(self, tp: int, chunk: ChunkLoad, shares_embedding: bool = False) -> float:
        p = chunk.layers * self.layer_params(tp)
        if chunk.embedding:
            p += self.embedding_params(tp)
        if chunk.head:
            p += self.head_params(tp, shares_embedding)
        return p

    # ---- activations per micro-batch per rank (bytes) -------------------------------------------
    def sequence_shards(self, tp: int) -> int:
        """Over how many ranks the sequence outside attention and the MLP is split."""
        return tp if self.sequence_parallel and tp > 1 else 1

    def layer_activation_bytes(self, tp: int) -> float:
        s, b, h, d = self.s, self.b, self.h, self.d
        per_token = ((d * 4 * h + 2 * h) / self.sequence_shards(tp)
                     + d * (2 * h + self.qkv + self.fc1 + self.f) / tp)
        if self.moe is not None:
            per_token = moe_activation_per_token(self, per_token, tp)
        if not self.flash_attention:
            per_token += (2 * d + 1) * self.a * s / tp
        return s * b * per_token

    def embedding_activation_bytes(self, tp: int = 1) -> float:
        return self.s * self.b * self.h / self.sequence_shards(tp)  # embedding dropout mask

    def head_activation_bytes(self, tp: int) -> float:
        # LN in, head in (a sequence slice each with sequence parallelism), fp32 logits
        return self.s * self.b * (2 * self.d * self.h / self.sequence_shards(tp) + 4 * self.V / tp)

    def chunk_activation_bytes(self, tp: int, chunk: ChunkLoad) -> float:
        act = chunk.layers * self.layer_activation_bytes(tp)
        if chunk.embedding:
            act += self.embedding_activation_bytes(tp)
        if chunk.head:
            act += self.head_activation_bytes(tp)
        return act * chunk.inflight

    def stage_memory(self, tp: int, chunks: list[ChunkLoad]) -> Memory:
        shares = self.model.tie_embeddings and any(c.embedding for c in chunks)
        params = sum(self.chunk_params(tp, c, shares) for c in chunks)
        act = sum(self.chunk_activation_bytes(tp, c) for c in chunks)
        return Memory(params * self.d, params * self.d, params * OPTIMIZER_BYTES[self.d], act)

    def memory_limit(self, kind: str) -> float:
        k = self.inventory.kind(kind)
        return (k.memory_gib - k.reserved_gib) * GIB

    # ---- time (seconds) ------------------------------------------------------------------------
    def _speed(self, k: DeviceKind, tp: int) -> float:
        """Achieved FLOP/s of one TP group."""
        return tp * k.tflops * 1e12 * k.mfu * k.tp_efficiency ** math.log2(tp)

    def _tp_allreduce(self, k: DeviceKind, tp: int) -> float:
        return ring_allreduce_time(self.b * self.s * self.h * self.d, tp, k.intra_bw_gbps)

    def layer_time(self, kind: str, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds of one decoder layer for one micro-batch."""
        key = ("layer", kind, tp)
        if key not in self._cache:
            k = self.inventory.kind(kind)
            fwd = self.layer_flops() / self._speed(k, tp)
            mlp_comm = self._tp_allreduce(k, tp) if self.moe is None else \
                moe_dispatch_time(self, k, tp)
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

    def chunk_time(self, kind: str, tp: int, chunk: ChunkLoad) -> tuple[float, float]:
        lf, lb = self.layer_time(kind, tp)
        f, b = chunk.layers * lf, chunk.layers * lb
        if chunk.embedding:
            ef, eb = self.embedding_time(kind, tp)
            f, b = f + ef, b + eb
        if chunk.head:
            hf, hb = self.head_time(kind, tp)
            f, b = f + hf, b + hb
        return f, b

    def boundary_bytes(self) -> float:
        return self.b * self.s * self.h * self.d

    def boundary_time(self, src_kind: str, dst_kind: str, dst_tp: int) -> float:
        """One activation (or gradient) from a stage leader to the next stage, all its ranks."""
        nbytes = self.boundary_bytes()
        src, dst = self.inventory.kind(src_kind), self.inventory.kind(dst_kind)
        link = self.inventory.link(src_kind, dst_kind)
        t = nbytes / (link.bandwidth_gbps * GB) + link.latency_us * 1e-6
        if src.device != dst.device:  # host-staged: copy to host, gloo, copy to device
            t += sum(nbytes / (k.host_bw_gbps * GB) for k in (src, dst) if k.device != "cpu")
        if dst_tp > 1:  # leader broadcasts inside its TP group
            t += nbytes / (dst.intra_bw_gbps * GB)
        return t

    def dp_allreduce_time(self, kind: str, params_per_rank: float, dp: int) -> float:
        """Gradient all-reduce across replicas (not overlapped with the pipeline: conservative)."""
        return ring_allreduce_time(params_per_rank * self.d, dp,
                                   self.inventory.link(kind, kind).bandwidth_gbps)


# ---- mixture of experts: what a MoE layer adds to a layer's price ------------------------------
@dataclass(frozen=True)
class MoEShape:
    """A MoE model's experts: E per MoE layer, ``topk`` per token, each an MLP of width ``ffn``
    (``fc1`` wide with a gate); ``share``: the fraction of the layers that are MoE layers."""

    experts: int
    topk: int
    ffn: int
    fc1: int
    share: float


def moe_shape(model: ModelConfig) -> MoEShape | None:
    if not model.num_moe_experts:
        return None
    fm = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    layers = model.moe_layers()
    return MoEShape(model.num_moe_experts, model.moe_router_topk, fm,
                    2 * fm if model.gated_linear_unit else fm, sum(layers) / len(layers))


def moe_mlp_flops(cost: CostModel, dense_mlp: float) -> float:
    """Forward FLOPs of the MLP, per layer on average: a MoE layer's are the active ones, the
    router over E experts plus ``topk`` expert MLPs per token."""
    e, b, s, h = cost.moe, cost.b, cost.s, cost.h
    moe = 2 * b * s * h * e.experts + e.topk * (2 * b * s * h * e.fc1 + 2 * b * s * e.ffn * h)
    return e.share * moe + (1 - e.share) * dense_mlp


def moe_layer_params(cost: CostModel, dense_layer: float, tp: int) -> float:
    """Parameters per rank, per layer on average: a MoE layer holds every expert (E * expert /
    tp per rank: spread over ep and split over tp / ep of the stage's TP ranks) and the
    router (replicated) in place of the dense MLP."""
    e, h = cost.moe, cost.h
    dense_mlp = (h * cost.fc1 + cost.f * h) / tp
    moe_mlp = e.experts * (h * e.fc1 + e.ffn * h) / tp + e.experts * h
    return dense_layer - e.share * dense_mlp + e.share * moe_mlp


def moe_activation_per_token(cost: CostModel, dense: float, tp: int) -> float:
    """Activation bytes per token, per layer on average: a MoE layer keeps the router's fp32
    probabilities, the ``topk`` dispatched copies of the token (all-gathered over the TP
    group) and their expert activations, in place of the dense MLP's."""
    e, d, h = cost.moe, cost.d, cost.h
    dense_mlp = d * (cost.fc1 + cost.f) / tp
    moe_mlp = 4 * e.experts + e.topk * d * (h + (e.fc1 + e.ffn) / tp)
    return dense - e.share * dense_mlp + e.share * moe_mlp


def moe_dispatch_time(cost: CostModel, k: DeviceKind, tp: int) -> float:
    """The MLP's communication per layer and direction, on average: a MoE layer's token
    dispatch all-gathers the stage's ``b*s*h`` tokens over its TP group and reduce-scatters
    the expert outputs (megatron's all-gather dispatcher), a dense layer all-reduces."""
    dispatch = ring_allreduce_time(cost.b * cost.s * cost.h * cost.d, tp, k.intra_bw_gbps)
    return cost.moe.share * dispatch + (1 - cost.moe.share) * cost._tp_allreduce(k, tp)
