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
* Memory per rank, as ldt configures megatron-core: weights (dtype), gradients in fp32
  (DDP's buffer), Adam state (16-bit training: fp32 main params + m, v = 12 bytes/param; fp32:
  m, v = 8): 18 bytes/param with 16-bit weights, 16 with fp32. No distributed optimizer.
  Parameters follow the family: biases only where the model has them (``add_bias_linear``,
  ``add_qkv_bias``), LayerNorm weight + bias or RMSNorm weight, a position table only for
  learned absolute positions.
  Activations per layer: what megatron-core's local layers keep for backward at dropout 0,
  part by part (:meth:`CostModel.layer_parts`), checked against the estimator's measurement
  of megatron's own code (``ldt.memory``; within 1% over GPT / Llama families, fp32 / bf16,
  TP 1 / 2, sequence parallelism, flash / local attention: tests/test_plan_cost.py). With 16-bit
  activations (d = 2), a GPT layer (f = 4h, no gate, MHA) keeps ``32 sbh`` bytes with flash
  attention and ``+ sb(6a + 1)s`` without it, where Korthikanti et al. (2022) count
  ``34 sbh + 5 as^2 b``: ldt trains at dropout 0 (no masks, no dropout output) and megatron's
  local softmax runs in fp32 (4 + 2 bytes per score). A Llama layer adds RMSNorm's fp32
  products, RoPE's rotated q, k and tables, and SwiGLU's activation and product.
  Recomputation (megatron's, per stage): ``full`` keeps only each recomputed group's input
  (``s*b*h*d``), ``selective`` drops the recomputed modules' own tensors; the recomputed
  forward is added to the backward time. Times the micro-batches a chunk holds in flight;
  each chunk also holds its received input.
  With sequence parallelism (``model.sequence_parallel``) on a stage of TP t > 1 the norms'
  part is split along the sequence too (megatron's column-parallel layers save their local
  slice and gather it again in backward), so the layer is divided by t except RoPE's tables;
  the logits stay ``4V/t``. The TP all-reduces become an all-gather plus a reduce-scatter of
  the same volume: same time.
* Attention with an explicit head size d (``model.kv_channels``, Qwen3) uses ``a*d`` in place of
  ``h`` for the queries, the output projection's input and the attention core.
* Mixture of experts (``model.num_moe_experts``; the functions at the end of this file): a MoE
  layer's MLP costs what one token activates, the router ``2bshE`` plus ``topk`` experts of
  width ``fm``; its weights are all E experts (``E * expert / tp`` per rank: the experts are
  split or spread over the stage's TP ranks whatever its ``ep``), its activations hold the
  ``topk`` dispatched copies of every token; its token dispatch (megatron's all-gather
  dispatcher: all-gather the stage's tokens, reduce-scatter the outputs over the TP group)
  takes the place of the dense MLP's TP collectives, with the same volume. A model with dense
  and MoE layers (``model.moe_layer_freq``) prices each chunk by the layers it holds
  (:attr:`ChunkLoad.moe_layers`: a chunk of n layers, k of them MoE, costs k MoE layers and
  n - k dense ones); where a chunk's place in the model is not known, at the model's average.
* A stage boundary carries ``b*s*h`` elements: ``bytes / link_bw + latency``, plus a device->host
  and host->device copy where the device types differ (host-staged gloo), plus the receiving
  stage's TP broadcast (the leader receives and broadcasts, see DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Optional

from ldt.config import ModelConfig, RecomputeConfig
from ldt.config.load import config_dict
from ldt.config.model import fused_attention
from ldt.plan.inventory import DTYPE_BYTES, DeviceKind, Inventory
from ldt.topology.device import plan_boundary
from ldt.topology.transport import FANOUT, carry, fanout_boundary

GB = 1e9
GIB = 2**30
OPTIMIZER_BYTES = {2: 12, 4: 8}  # per param: fp32 master + m + v (16-bit) / m + v (fp32)
GRAD_BYTES = 4  # megatron's DDP accumulates and reduces gradients in fp32 (fp32 main params)


@dataclass(frozen=True)
class Recompute:
    """A stage's activation recomputation (megatron's; ``cluster.stages[i].recompute``)."""

    granularity: str
    """``selective`` or ``full``."""
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: tuple[str, ...] = ()
    """``selective``: the recomputed modules (empty: megatron's default, the core attention)."""

    @classmethod
    def of(cls, rc) -> Optional["Recompute"]:
        """From a RecomputeConfig (or None, or a granularity ``none``)."""
        if rc is None or rc.granularity in (None, "none"):
            return None
        return cls(rc.granularity, rc.method, rc.num_layers, tuple(rc.modules or ()))

    def to_config(self) -> RecomputeConfig:
        """As ``cluster.stages[i].recompute``."""
        full = self.granularity == "full"
        return RecomputeConfig(self.granularity, self.method if full else None,
                               self.num_layers if full else None,
                               None if full or not self.modules else list(self.modules))

    def config(self) -> dict:
        """The ``cluster.stages[i].recompute`` fields that are set, as plain data."""
        return config_dict(self.to_config())

    def describe(self) -> str:
        if self.granularity == "full":
            return f"full/{self.method}/{self.num_layers}"
        return "selective" + (f"({','.join(self.modules)})" if self.modules else "")


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


@dataclass(frozen=True)
class Memory:
    """Per-rank memory of one stage, bytes."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float = 0.0
    """Received tensors waiting in boundary buffers."""
    transient: float = 0.0
    """The peak above all that while one micro-batch's backward runs."""
    wstore: float = 0.0
    """A zero-bubble schedule's W store at its peak (:meth:`CostModel.wstore_bytes` x the
    entries held); 0 under the unsplit schedules."""

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.buffers
                + self.transient + self.wstore)


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

    def _share(self, share: Optional[float]) -> float:
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
            mlp = _mix(mlp, moe_mlp_flops(self), self._share(share))
        return 2 * b * s * h * self.qkv + 2 * b * s * self.hd * h + mlp + 4 * b * s * s * self.hd

    def layer_linear_flops(self, share: Optional[float] = None) -> float:
        """The part of :meth:`layer_flops` in megatron's column- and row-parallel linear layers
        (QKV, projection, the MLP's or the active experts' fc1 and fc2): what their weight
        gradient costs again in the backward, the W of a zero-bubble schedule (the attention
        core has no weights; a MoE router's is not split, ``patches/wgrad_split.py``)."""
        b, s, h = self.b, self.s, self.h
        share = self._share(share)
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
        return out if self.moe is None else moe_layer_params(self, out, tp, self._share(share))

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

    # ---- activations per micro-batch per rank (bytes) -------------------------------------------
    def sequence_shards(self, tp: int) -> int:
        """Over how many ranks the sequence outside attention and the MLP is split."""
        return tp if self.sequence_parallel and tp > 1 else 1

    def _upcast(self) -> int:
        """Bytes per element a 16-bit run adds where megatron's local code works in fp32 and
        keeps a 16-bit copy (softmax, RMSNorm): 4 + d for 16-bit, 4 for fp32."""
        return 4 + (self.d if self.d < 4 else 0)

    def _norm_bytes(self) -> float:
        """Per token, one norm's internals beyond its input: RMSNorm keeps an fp32 product
        (and its 16-bit copy), torch's LayerNorm only per-token statistics."""
        return self._upcast() * self.h if self.model.normalization == "RMSNorm" else 0.0

    def _qk_norm_bytes(self) -> float:
        """Per token at TP 1, what ``qk_layernorm`` adds (measured on megatron's layers with
        the estimator, tests/test_plan_cost.py's ``qwen3`` family): each norm's output (RoPE's
        input then, a view of the QKV output before) and RMSNorm's internals per element, and
        its fp32 inverse RMS per head. In fp32 a key element costs 4 bytes, not 8 (measured;
        one of its tensors is not a new one there)."""
        q, k = self.hd, self.hd * self.g // self.a
        per_q = self.d + self._upcast()
        per_k = per_q if self.d < 4 else 4
        return per_q * q + per_k * k + 4 * (self.a + self.g)

    def _rope(self) -> bool:
        return self.model.position_embedding_type == "rope"

    def flash(self, kind: str) -> bool:
        """Whether a stage of ``kind`` runs fused (flash) attention (:attr:`flash_attention`)."""
        if self.flash_attention is not None:
            return self.flash_attention
        return fused_attention(self.model, self.inventory.kind(kind).device)

    def layer_parts(self, kind: str, tp: int, share: Optional[float] = None
                    ) -> dict[str, float]:
        """Bytes per token one decoder layer keeps for backward, by part (what megatron-core's
        local layers save with dropout 0, as the estimator measures them: ``ldt.memory``).

        ``norms``: the two norm inputs, the QKV and fc1 inputs, the norms' internals (all on
        the sequence slice with sequence parallelism); ``qkv``: the fused QKV output, a
        contiguous copy of q with grouped-query heads (no RoPE), RoPE's rotated q and k and its
        cos / sin tables, Qwen3's q / k norms; ``core_attn``: flash's log-sum-exp, or the local attention's fp32
        softmax, its 16-bit copy and the mask; ``attn_out``: the projection's input; ``mlp``:
        fc1's output, fc2's input, a gated MLP's activation and product. Korthikanti et al.
        (2022) count ``34 sbh + 5 as^2 b`` bytes with 16-bit activations: they add dropout
        masks (none at dropout 0) and a second copy of the attention probabilities (dropout's
        output), and leave out RMSNorm's and RoPE's tensors and the fp32 softmax. ``share``:
        :meth:`layer_flops`'."""
        h, d, a, s = self.h, self.d, self.a, self.s
        sp = self.sequence_shards(tp)
        head_dim = self.hd // a
        q_width = self.hd
        k_width = self.hd * self.g // a
        qkv = self.qkv
        if self.g < a and not self._rope():
            qkv += q_width  # megatron reshapes q out of the grouped QKV: a copy
        if self._rope():
            qkv += q_width + k_width
        rope_tables = 4 * int(head_dim * self.model.rotary_percent) * d if self._rope() else 0
        if self.flash(kind):
            core = 4 * a / tp  # log-sum-exp, fp32
        else:
            core = (self._upcast() * a + 1) * s / tp
        mlp = self._dense_mlp_bytes(tp)
        if self.model.qk_layernorm:  # Qwen3: q and k normalized per head, before RoPE
            qkv += self._qk_norm_bytes() / d
        if self.moe is not None:  # a MoE layer's router and dispatched tokens
            mlp = moe_activation_per_token(self, mlp, tp, self._share(share))
        return {"norms": (d * 4 * h + 2 * self._norm_bytes()) / sp,
                "qkv": d * qkv / tp + rope_tables, "core_attn": core,
                "attn_out": d * self.hd / tp, "mlp": mlp}

    def _dense_mlp_bytes(self, tp: int) -> float:
        """A dense MLP's activation bytes per token (:meth:`layer_parts`' ``mlp``)."""
        return self.d * (self.fc1 + self.f + (2 * self.f if self.model.gated_linear_unit
                                              else 0)) / tp

    def layer_activation_bytes(self, kind: str, tp: int, recompute=None,
                               share: Optional[float] = None) -> float:
        """One decoder layer, one micro-batch: without recomputation, or with a selective one
        (the recomputed modules keep only their inputs, which other parts keep anyway; a
        selective ``mlp`` only a dense layer's: megatron's ``recompute_mlp`` is off in a MoE
        layer). ``share``: :meth:`layer_flops`'."""
        share = self._share(share)
        parts = self.layer_parts(kind, tp, share)
        for module in _selective_modules(recompute):
            if module == "core_attn":
                parts["core_attn"] = 0.0
            elif module == "mlp":  # the dense layers' (megatron leaves the experts' kept)
                parts["mlp"] -= (1.0 - share) * self._dense_mlp_bytes(tp)
            elif module == "layernorm":  # the norm outputs (QKV, fc1 inputs) and internals
                parts["norms"] -= (2 * self.d * self.h + 2 * self._norm_bytes()) / \
                    self.sequence_shards(tp)
        return self.s * self.b * sum(parts.values())

    def boundary_activation_bytes(self, tp: int) -> float:
        """A ``[s, b, h]`` tensor of this stage (its sequence slice with sequence parallelism):
        a chunk's input, an embedding's output, a fully recomputed group's kept input."""
        return self.s * self.b * self.h * self.d / self.sequence_shards(tp)

    def embedding_activation_bytes(self, tp: int = 1) -> float:
        return self.boundary_activation_bytes(tp)  # its output

    def head_activation_bytes(self, tp: int) -> float:
        # the final norm's input and internals, the head's input (the whole sequence), the
        # cross entropy's fp32 logits
        norm = (self.d * self.h + self._norm_bytes()) / self.sequence_shards(tp)
        return self.s * self.b * (norm + self.d * self.h + 4 * self.V / tp)

    def decoder_activation_bytes(self, kind: str, tp: int, layers: int, recompute=None,
                                 share: Optional[float] = None) -> float:
        """``layers`` decoder layers of one chunk under megatron's recomputation: full keeps
        only each group's input (uniform: every ``num_layers`` layers; block: the first
        ``num_layers`` layers one by one, the rest whole). ``share``: :meth:`layer_flops`'."""
        granularity = getattr(recompute, "granularity", None)
        if granularity != "full":
            return layers * self.layer_activation_bytes(kind, tp, recompute, share)
        n = recompute.num_layers
        if recompute.method == "uniform":
            return math.ceil(layers / n) * self.boundary_activation_bytes(tp)
        kept = min(n, layers)
        return (kept * self.boundary_activation_bytes(tp)
                + (layers - kept) * self.layer_activation_bytes(kind, tp, share=share))

    def chunk_activation_bytes(self, kind: str, tp: int, chunk: ChunkLoad) -> float:
        act = self.decoder_activation_bytes(kind, tp, chunk.layers, chunk.recompute,
                                            self.moe_share(chunk))
        act += (self.embedding_activation_bytes(tp) if chunk.embedding
                else self.boundary_activation_bytes(tp))  # the received input
        if chunk.head:
            act += self.head_activation_bytes(tp)
        return act * chunk.inflight

    def recompute_transient(self, kind: str, tp: int, chunk: ChunkLoad) -> float:
        """What a chunk's recomputation makes again during one micro-batch's backward, on top
        of what it keeps (measured with the estimator on megatron's layers, h 16, two layers:
        tests/test_plan_cost_oracles.py): a full ``uniform`` group's ``n`` layers, rebuilt at
        once; ``block`` recomputing every layer of the chunk, the last one (with fewer, the
        recomputed layers run after the kept ones were freed: nothing more); a selective
        recomputation, the recomputed modules' part of one layer."""
        rc = chunk.recompute
        if rc is None or chunk.layers == 0:
            return 0.0
        share = self.moe_share(chunk)  # a layer of the chunk, on average
        layer = self.layer_activation_bytes(kind, tp, share=share)
        if rc.granularity == "full":
            if rc.method == "uniform":
                return min(rc.num_layers, chunk.layers) * layer
            return layer if rc.num_layers >= chunk.layers else 0.0
        return layer - self.layer_activation_bytes(kind, tp, rc, share)

    def attention_backward_bytes(self, kind: str, tp: int) -> float:
        """What megatron's local attention makes during one layer's backward: the gradients of
        the probabilities and the scores and the fp32 softmax's work, about ``4 d`` bytes per
        score (the estimator on megatron's layers, llama_tiny at s 1024 / 2048, TP 1 / 2: 15.1
        - 15.3 bytes in fp32, 7.6 - 7.9 in bf16; tests/test_plan_cost_oracles.py). Fused
        attention recomputes its blocks: nothing of ``s x s``."""
        if self.flash(kind):
            return 0.0
        return 4 * self.d * self.a / tp * self.s * self.s * self.b

    def stage_memory(self, kind: str, tp: int, chunks: list[ChunkLoad], recv_buffers: int = 0
                     ) -> Memory:
        """Per rank, as ldt configures megatron-core: 16-bit weights with fp32 gradients
        (DDP reduces in fp32), fp32 main params and Adam's two moments; fp32 training keeps no
        copy. ``recv_buffers``: received ``[s, b, h]`` tensors waiting at once. The backward
        transient: two ``[s, b, h]`` tensors, two more that sends may still hold (ldt's
        runtime lets a send go once it completed, ldt.memory.inflight), with the head the
        logits' gradient (``s*b*V/t``), what recomputation rebuilds
        (:meth:`recompute_transient`), and local attention's backward
        (:meth:`attention_backward_bytes`)."""
        key = (self.flash(kind), tp, tuple(chunks), recv_buffers)
        if key in self._memories:
            return self._memories[key]
        shares = self.model.tie_embeddings and any(c.embedding for c in chunks)
        boundary = self.boundary_activation_bytes(1)  # whole sequence: the leader's buffer
        params, act, transient = 0.0, 0.0, 0.0
        for c in chunks:
            own = self.chunk_params(tp, c, shares)
            params += own
            act += self.chunk_activation_bytes(kind, tp, c)
            logits = self.d * self.s * self.b * self.V / tp if c.head else 0.0
            # both: the head's backward runs first, but its end overlaps the last layer's
            # (llama3_8b's edge, end chunk with selective layernorm + mlp: the estimate's
            # transient 2.59 GiB, the logits' gradient alone 1.96, the recomputed part 1.60)
            attention = self.attention_backward_bytes(kind, tp) if c.layers else 0.0
            transient = max(transient, 4 * boundary + logits
                            + self.recompute_transient(kind, tp, c) + attention)
        memory = Memory(params * self.d, params * GRAD_BYTES, params * OPTIMIZER_BYTES[self.d],
                        act, recv_buffers * boundary, transient)
        self._memories[key] = memory
        return memory

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
        share = self._share(share)
        key = ("layer", kind, tp, share)
        if key not in self._cache:
            k = self.inventory.kind(kind)
            fwd = self.layer_flops(share) / self._speed(k, tp)
            mlp_comm = self._tp_allreduce(k, tp) if self.moe is None else \
                _mix(self._tp_allreduce(k, tp), moe_dispatch_time(self, k, tp), share)
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
        core's ``4bs^2h``, the dense layers' MLP; the norms are negligible). ``share``: of
        the chunk's layers, as :meth:`layer_flops`'."""
        share = self._share(share)
        granularity = getattr(recompute, "granularity", None)
        if granularity == "full":
            n = layers if recompute.method == "uniform" else min(recompute.num_layers, layers)
            return n * self.layer_time(kind, tp, share)[0]
        b, s, h = self.b, self.s, self.h
        flops = {"core_attn": 4 * b * s * s * h,
                 "mlp": (1.0 - share) * (2 * b * s * h * self.fc1 + 2 * b * s * self.f * h)}
        per_layer = sum(flops.get(m, 0.0) for m in _selective_modules(recompute))
        return layers * per_layer / self._speed(self.inventory.kind(kind), tp)

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
            mlp = _mix(mlp, e.topk * (h + (e.fc1 + e.ffn) / t + h), self.moe_share(chunk))
        per_token = chunk.layers * (h + self.qkv / t + self.hd / t + h + mlp)
        if chunk.head:
            per_token += h + self.V / t
        return self.s * self.b * self.d * per_token

    def wgrad_transient(self, tp: int, chunk: ChunkLoad) -> float:
        """A zero-bubble W's own peak on a rank: the chunk's split linear layers' weight
        gradients made at once, in the weights' dtype, before DDP's hooks take them, and one
        more of the largest while autograd hands them over (the estimator on megatron's
        layers: llama_tiny h 256, TP 1 / 2, fp32 / bf16, the head's chunk too, exactly;
        llama_7b's edge end chunk 0.87 GiB; ``patches/wgrad_split.run_wgrad``). A MoE
        layer's linear weights are priced as its parameters less the norms."""
        h, t = self.h, tp
        weights = (h * self.qkv, self.hd * h, h * self.fc1, self.f * h)
        per_layer = sum(weights) / t
        if self.moe is not None:
            per_layer = _mix(per_layer, self.layer_params(t, 1.0) - 2 * self.norm,
                             self.moe_share(chunk))
        largest = max(weights) / t if chunk.layers else 0.0
        out = chunk.layers * per_layer
        if chunk.head:
            out += self.V * h / t
            largest = max(largest, self.V * h / t)
        return self.d * (out + largest)

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


def _selective_modules(recompute) -> list[str]:
    if getattr(recompute, "granularity", None) != "selective":
        return []
    return list(recompute.modules or ("core_attn",))


# ---- mixture of experts: what a MoE layer adds to a layer's price ------------------------------
@dataclass(frozen=True)
class MoEShape:
    """A MoE model's experts: E per MoE layer, ``topk`` per token, each an MLP of width ``ffn``
    (``fc1`` wide with a gate); ``share``: the fraction of the model's layers that are MoE
    layers (what a layer costs on average where a chunk's own are not known)."""

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


def _mix(dense: float, moe: float, share: float) -> float:
    """A layer's price where ``share`` of the layers it stands for are MoE layers."""
    return share * moe + (1 - share) * dense


def moe_mlp_flops(cost: CostModel) -> float:
    """Forward FLOPs of a MoE layer's MLP: the active ones, the router over E experts plus
    ``topk`` expert MLPs per token."""
    e, b, s, h = cost.moe, cost.b, cost.s, cost.h
    return 2 * b * s * h * e.experts + e.topk * (2 * b * s * h * e.fc1 + 2 * b * s * e.ffn * h)


def moe_layer_params(cost: CostModel, dense_layer: float, tp: int, share: float) -> float:
    """Parameters per rank of a layer, ``share`` of it a MoE layer: a MoE layer holds every
    expert (E * expert / tp per rank: spread over ep and split over tp / ep of the stage's TP
    ranks) and the router (replicated) in place of the dense MLP."""
    e, h = cost.moe, cost.h
    dense_mlp = (h * cost.fc1 + cost.f * h) / tp
    moe_mlp = e.experts * (h * e.fc1 + e.ffn * h) / tp + e.experts * h
    return dense_layer - share * dense_mlp + share * moe_mlp


def moe_activation_per_token(cost: CostModel, dense: float, tp: int, share: float) -> float:
    """Activation bytes per token of a layer's MLP, ``share`` of it a MoE layer: a MoE layer
    keeps the router's fp32 probabilities, the ``topk`` dispatched copies of the token
    (all-gathered over the TP group) and their expert activations, in place of the dense
    MLP's."""
    e, d, h = cost.moe, cost.d, cost.h
    dense_mlp = d * (cost.fc1 + cost.f) / tp
    moe_mlp = 4 * e.experts + e.topk * d * (h + (e.fc1 + e.ffn) / tp)
    return dense - share * dense_mlp + share * moe_mlp


def moe_dispatch_time(cost: CostModel, k: DeviceKind, tp: int) -> float:
    """A MoE layer's MLP communication per direction: its token dispatch all-gathers the
    stage's ``b*s*h`` tokens over its TP group and reduce-scatters the expert outputs
    (megatron's all-gather dispatcher), where a dense layer all-reduces."""
    return ring_allreduce_time(cost.b * cost.s * cost.h * cost.d, tp, k.intra_bw_gbps)
