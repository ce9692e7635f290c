"""Mixture of experts: what a MoE layer adds to a decoder layer's price.

Apart from :mod:`ldt.plan.cost` because a dense model never reaches it and because both the
cost model and its memory terms (:mod:`ldt.plan.memory_cost`) take from it; the functions
take the model's experts (a :class:`MoEShape`, as :func:`ldt.plan.cost.moe_shape` reads them
from the config, which comes no further) and the dimensions they need, or the
:class:`~ldt.plan.cost.CostModel` whose layer they price as ``cost`` (its shape: ``h``, ``d``,
``f``, ``fc1`` and ``moe``).

A MoE layer (``model.num_moe_experts``) costs in its MLP what one token activates, the router
``2bshE`` plus ``topk`` experts of width ``fm``; its weights are all E experts (``E * expert /
tp`` per rank: the experts are split or spread over the stage's TP ranks whatever its ``ep``),
its activations hold the ``topk`` dispatched copies of every token. Its token dispatch
(megatron's all-gather dispatcher: all-gather the stage's tokens, reduce-scatter the outputs
over the TP group) takes the place of the dense MLP's TP collectives, with the same volume
(:func:`ldt.plan.cost.moe_dispatch_time`, with the other collectives). A model with dense and
MoE layers (``model.moe_layer_freq``) prices each chunk by the layers it holds
(:attr:`ldt.plan.cost.ChunkLoad.moe_layers`: a chunk of n layers, k of them MoE, costs k MoE
layers and n - k dense ones); where a chunk's place in the model is not known, at the model's
average (:attr:`MoEShape.share`), each price :func:`mix`-ed.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def mix(dense: float, moe: float, share: float) -> float:
    """A layer's price where ``share`` of the layers it stands for are MoE layers."""
    return share * moe + (1 - share) * dense


def moe_mlp_flops(e: MoEShape, b: int, s: int, h: int) -> float:
    """Forward FLOPs of a MoE layer's MLP: the active ones, the router over E experts plus
    ``topk`` expert MLPs per token (``b`` sequences of ``s`` tokens of width ``h``)."""
    return 2 * b * s * h * e.experts + e.topk * (2 * b * s * h * e.fc1 + 2 * b * s * e.ffn * h)


def moe_layer_params(cost, dense_layer: float, tp: int, share: float) -> float:
    """Parameters per rank of a layer, ``share`` of it a MoE layer: a MoE layer holds every
    expert (E * expert / tp per rank: spread over ep and split over tp / ep of the stage's TP
    ranks) and the router (replicated) in place of the dense MLP."""
    e, h = cost.moe, cost.h
    dense_mlp = (h * cost.fc1 + cost.f * h) / tp
    moe_mlp = e.experts * (h * e.fc1 + e.ffn * h) / tp + e.experts * h
    return dense_layer - share * dense_mlp + share * moe_mlp


def moe_mlp_activation_per_token(cost, tp: int) -> float:
    """Activation bytes per token of a MoE layer's MLP (in place of a dense MLP's): the
    router's fp32 probabilities, the ``topk`` dispatched copies of the token (all-gathered
    over the TP group) and their expert activations."""
    e, d, h = cost.moe, cost.d, cost.h
    gated = cost.model.gated_linear_unit
    return 4 * e.experts + e.topk * d * (h + (e.fc1 + e.ffn + (2 * e.ffn if gated else 0)) / tp)
