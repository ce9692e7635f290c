"""Memory per rank of a stage: weights, gradients and optimizer state, the activations it keeps
for backward, the transient peak of a backward, and what recomputation changes.

Apart from :mod:`ldt.plan.cost` because it is a model of its own, rebuilt part by part from what
megatron-core's layers save and held to the estimator's measurements (``ldt.memory``), while the
cost model's FLOPs and times are not. The functions take the :class:`~ldt.plan.cost.CostModel`
whose stage they price as ``cost`` (its shape, its parameters per rank, its ``flash`` and
``sequence_shards``, its MoE share); a ``share`` is the fraction of MoE layers among the layers
priced, as in :meth:`~ldt.plan.cost.CostModel.layer_flops`; a ``chunk`` is a
:class:`~ldt.plan.cost.ChunkLoad`.

Memory per rank, as ldt configures megatron-core: weights (dtype), gradients in fp32 (DDP's
buffer), Adam state (16-bit training: fp32 main params + m, v = 12 bytes/param; fp32: m, v = 8):
18 bytes/param with 16-bit weights, 16 with fp32. No distributed optimizer.

Activations per layer: what megatron-core's local layers keep for backward at dropout 0,
part by part (:func:`layer_parts`), checked against the estimator's measurement of megatron's
own code (``ldt.memory``; within 1% over GPT / Llama families, fp32 / bf16, TP 1 / 2, sequence
parallelism, flash / local attention: tests/test_plan_cost.py). With 16-bit activations
(d = 2), a GPT layer (f = 4h, no gate, MHA) keeps ``32 sbh`` bytes with flash attention and
``+ sb(6a + 1)s`` without it, where Korthikanti et al. (2022) count ``34 sbh + 5 as^2 b``: ldt
trains at dropout 0 (no masks, no dropout output) and megatron's local softmax runs in fp32
(4 + 2 bytes per score). A Llama layer adds RMSNorm's fp32 products, RoPE's rotated q, k and
tables, and SwiGLU's activation and product. Recomputation (megatron's, per stage,
:class:`Recompute`): ``full`` keeps only each recomputed group's input (``s*b*h*d``),
``selective`` drops the recomputed modules' own tensors; the recomputed forward is added to the
backward time (:meth:`~ldt.plan.cost.CostModel.recompute_time`). Times the micro-batches a chunk
holds in flight; each chunk also holds its received input. With sequence parallelism
(``model.sequence_parallel``) on a stage of TP t > 1 the norms' part is split along the
sequence too (megatron's column-parallel layers save their local slice and gather it again in
backward), so the layer is divided by t except RoPE's tables; the logits stay ``4V/t``. A MoE
layer's MLP part: :func:`ldt.plan.moe_cost.moe_mlp_activation_per_token`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ldt.config import RecomputeConfig
from ldt.config.load import config_dict
from ldt.plan.moe_cost import mix, moe_mlp_activation_per_token

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
    """A zero-bubble schedule's W store at its peak
    (:meth:`~ldt.plan.cost.CostModel.wstore_bytes` x the entries held); 0 under the unsplit
    schedules."""

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.buffers
                + self.transient + self.wstore)


def selective_modules(recompute) -> list[str]:
    """The modules a selective recomputation recomputes (megatron's default: the core
    attention); none for a full one or none at all."""
    if getattr(recompute, "granularity", None) != "selective":
        return []
    return list(recompute.modules or ("core_attn",))


# ---- per token: one decoder layer's parts -------------------------------------------------------
def _upcast(cost) -> int:
    """Bytes per element a 16-bit run adds where megatron's local code works in fp32 and
    keeps a 16-bit copy (softmax, RMSNorm): 4 + d for 16-bit, 4 for fp32."""
    return 4 + (cost.d if cost.d < 4 else 0)


def _norm_bytes(cost) -> float:
    """Per token, one norm's internals beyond its input: RMSNorm keeps an fp32 product
    (and its 16-bit copy), torch's LayerNorm only per-token statistics."""
    return _upcast(cost) * cost.h if cost.model.normalization == "RMSNorm" else 0.0


def _qk_norm_bytes(cost) -> float:
    """Per token at TP 1, what ``qk_layernorm`` adds (measured on megatron's layers with
    the estimator, tests/test_plan_cost.py's ``qwen3`` family): each norm's output (RoPE's
    input then, a view of the QKV output before) and RMSNorm's internals per element, and
    its fp32 inverse RMS per head. In fp32 a key element costs 4 bytes, not 8 (measured;
    one of its tensors is not a new one there)."""
    q, k = cost.hd, cost.hd * cost.g // cost.a
    per_q = cost.d + _upcast(cost)
    per_k = per_q if cost.d < 4 else 4
    return per_q * q + per_k * k + 4 * (cost.a + cost.g)


def _rope(cost) -> bool:
    return cost.model.position_embedding_type == "rope"


def layer_parts(cost, kind: str, tp: int, share: Optional[float] = None
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
    :meth:`~ldt.plan.cost.CostModel.layer_flops`'."""
    h, d, a, s = cost.h, cost.d, cost.a, cost.s
    sp = cost.sequence_shards(tp)
    head_dim = cost.hd // a
    q_width = cost.hd
    k_width = cost.hd * cost.g // a
    qkv = cost.qkv
    if cost.g < a and not _rope(cost):
        qkv += q_width  # megatron reshapes q out of the grouped QKV: a copy
    if _rope(cost):
        qkv += q_width + k_width
    rope_tables = 4 * int(head_dim * cost.model.rotary_percent) * d if _rope(cost) else 0
    if cost.flash(kind):
        core = 4 * a / tp  # log-sum-exp, fp32
    else:
        core = (_upcast(cost) * a + 1) * s / tp
    mlp = _dense_mlp_bytes(cost, tp)
    if cost.model.qk_layernorm:  # Qwen3: q and k normalized per head, before RoPE
        qkv += _qk_norm_bytes(cost) / d
    if cost.moe is not None:  # a MoE layer's router and dispatched tokens
        mlp = mix(mlp, moe_mlp_activation_per_token(cost, tp), cost.layer_share(share))
    return {"norms": (d * 4 * h + 2 * _norm_bytes(cost)) / sp,
            "qkv": d * qkv / tp + rope_tables, "core_attn": core,
            "attn_out": d * cost.hd / tp, "mlp": mlp}


def _dense_mlp_bytes(cost, tp: int) -> float:
    """A dense MLP's activation bytes per token (:func:`layer_parts`' ``mlp``)."""
    return cost.d * (cost.fc1 + cost.f + (2 * cost.f if cost.model.gated_linear_unit
                                          else 0)) / tp


# ---- per micro-batch per rank (bytes) ------------------------------------------------------------
def layer_activation_bytes(cost, kind: str, tp: int, recompute=None,
                           share: Optional[float] = None) -> float:
    """One decoder layer, one micro-batch: without recomputation, or with a selective one
    (the recomputed modules keep only their inputs, which other parts keep anyway; a
    selective ``mlp`` only a dense layer's: megatron's ``recompute_mlp`` is off in a MoE
    layer, whose MLP ``moe`` recomputes). ``share``: :meth:`~ldt.plan.cost.CostModel.layer_flops`'."""
    share = cost.layer_share(share)
    parts = layer_parts(cost, kind, tp, share)
    for module in selective_modules(recompute):
        if module == "core_attn":
            parts["core_attn"] = 0.0
        elif module == "mlp":  # the dense layers' (megatron leaves the experts' kept)
            parts["mlp"] -= (1.0 - share) * _dense_mlp_bytes(cost, tp)
        elif module == "moe" and cost.moe is not None:  # the MoE layers' whole MLP: its
            # input is the pre-MLP norm's output, which the norms' part keeps
            parts["mlp"] -= share * moe_mlp_activation_per_token(cost, tp)
        elif module == "layernorm":  # the norm outputs (QKV, fc1 inputs) and internals
            parts["norms"] -= (2 * cost.d * cost.h + 2 * _norm_bytes(cost)) / \
                cost.sequence_shards(tp)
    return cost.s * cost.b * sum(parts.values())


def boundary_activation_bytes(cost, tp: int) -> float:
    """A ``[s, b, h]`` tensor of this stage (its sequence slice with sequence parallelism):
    a chunk's input, an embedding's output, a fully recomputed group's kept input."""
    return cost.s * cost.b * cost.h * cost.d / cost.sequence_shards(tp)


def embedding_activation_bytes(cost, tp: int = 1) -> float:
    return boundary_activation_bytes(cost, tp)  # its output


def head_activation_bytes(cost, tp: int) -> float:
    # the final norm's input and internals, the head's input (the whole sequence), the
    # cross entropy's fp32 logits
    norm = (cost.d * cost.h + _norm_bytes(cost)) / cost.sequence_shards(tp)
    return cost.s * cost.b * (norm + cost.d * cost.h + 4 * cost.V / tp)


def decoder_activation_bytes(cost, kind: str, tp: int, layers: int, recompute=None,
                             share: Optional[float] = None) -> float:
    """``layers`` decoder layers of one chunk under megatron's recomputation: full keeps
    only each group's input (uniform: every ``num_layers`` layers; block: the first
    ``num_layers`` layers one by one, the rest whole). ``share``: as in
    :meth:`~ldt.plan.cost.CostModel.layer_flops`."""
    granularity = getattr(recompute, "granularity", None)
    if granularity != "full":
        return layers * layer_activation_bytes(cost, kind, tp, recompute, share)
    n = recompute.num_layers
    if recompute.method == "uniform":
        return math.ceil(layers / n) * boundary_activation_bytes(cost, tp)
    kept = min(n, layers)
    return (kept * boundary_activation_bytes(cost, tp)
            + (layers - kept) * layer_activation_bytes(cost, kind, tp, share=share))


def chunk_activation_bytes(cost, kind: str, tp: int, chunk) -> float:
    act = decoder_activation_bytes(cost, kind, tp, chunk.layers, chunk.recompute,
                                   cost.moe_share(chunk))
    act += (embedding_activation_bytes(cost, tp) if chunk.embedding
            else boundary_activation_bytes(cost, tp))  # the received input
    if chunk.head:
        act += head_activation_bytes(cost, tp)
    return act * chunk.inflight


def recompute_transient(cost, kind: str, tp: int, chunk) -> float:
    """What a chunk's recomputation makes again during one micro-batch's backward, on top
    of what it keeps (measured with the estimator on megatron's layers, h 16, two layers:
    tests/test_plan_cost_oracles.py): a full ``uniform`` group's ``n`` layers, rebuilt at
    once; ``block`` recomputing every layer of the chunk, the last one (with fewer, the
    recomputed layers run after the kept ones were freed: nothing more); a selective
    recomputation, the recomputed modules' part of one layer."""
    rc = chunk.recompute
    if rc is None or chunk.layers == 0:
        return 0.0
    share = cost.moe_share(chunk)  # a layer of the chunk, on average
    layer = layer_activation_bytes(cost, kind, tp, share=share)
    if rc.granularity == "full":
        if rc.method == "uniform":
            return min(rc.num_layers, chunk.layers) * layer
        return layer if rc.num_layers >= chunk.layers else 0.0
    return layer - layer_activation_bytes(cost, kind, tp, rc, share)


def attention_backward_bytes(cost, kind: str, tp: int) -> float:
    """What megatron's local attention makes during one layer's backward: the gradients of
    the probabilities and the scores and the fp32 softmax's work, about ``4 d`` bytes per
    score (the estimator on megatron's layers, llama_tiny at s 1024 / 2048, TP 1 / 2: 15.1
    - 15.3 bytes in fp32, 7.6 - 7.9 in bf16; tests/test_plan_cost_oracles.py). Fused
    attention recomputes its blocks: nothing of ``s x s``."""
    if cost.flash(kind):
        return 0.0
    return 4 * cost.d * cost.a / tp * cost.s * cost.s * cost.b


# ---- a stage, per rank (bytes) ------------------------------------------------------------------
def stage_memory(cost, kind: str, tp: int, chunks: list, recv_buffers: int = 0) -> Memory:
    """Per rank, as ldt configures megatron-core: 16-bit weights with fp32 gradients
    (DDP reduces in fp32), fp32 main params and Adam's two moments; fp32 training keeps no
    copy. ``recv_buffers``: received ``[s, b, h]`` tensors waiting at once. The backward
    transient: two ``[s, b, h]`` tensors, two more that sends may still hold (ldt's
    runtime lets a send go once it completed, ldt.memory.inflight), with the head the
    logits' gradient (``s*b*V/t``), what recomputation rebuilds
    (:func:`recompute_transient`), and local attention's backward
    (:func:`attention_backward_bytes`)."""
    shares = cost.model.tie_embeddings and any(c.embedding for c in chunks)
    boundary = boundary_activation_bytes(cost, 1)  # whole sequence: the leader's buffer
    params, act, transient = 0.0, 0.0, 0.0
    for c in chunks:
        own = cost.chunk_params(tp, c, shares)
        params += own
        act += chunk_activation_bytes(cost, kind, tp, c)
        logits = cost.d * cost.s * cost.b * cost.V / tp if c.head else 0.0
        # both: the head's backward runs first, but its end overlaps the last layer's
        # (llama3_8b's edge, end chunk with selective layernorm + mlp: the estimate's
        # transient 2.59 GiB, the logits' gradient alone 1.96, the recomputed part 1.60)
        attention = attention_backward_bytes(cost, kind, tp) if c.layers else 0.0
        transient = max(transient, 4 * boundary + logits
                        + recompute_transient(cost, kind, tp, c) + attention)
    return Memory(params * cost.d, params * GRAD_BYTES, params * OPTIMIZER_BYTES[cost.d],
                  act, recv_buffers * boundary, transient)
