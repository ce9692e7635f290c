"""Tensor-parallel sharding rules of GPTModel parameters, by (canonical) name.

One table says which dimension of each parameter megatron-core splits across TP ranks. It is
what lets ldt move weights between layouts with different TP sizes per stage (reference
models in the parity tests, checkpoint conversion) without building both models. The full
(TP=1) tensor is megatron's global form, the one its distributed checkpoints hold.

Two layouts are not a plain split, and both are megatron-core's (``tests/test_models.py``
checks these rules against each module's ``sharded_state_dict()``):

- a gated MLP's ``linear_fc1`` (SwiGLU) is ``[gate; up]`` in full and ``[gate_r; up_r]`` on
  TP rank r (megatron's ``apply_swiglu_sharded_factory``): each half is split on its own;
- ``linear_qkv`` with GQA is grouped per query group, ``[q_g (heads/groups rows), k_g, v_g]``
  for each group g in turn (``SelfAttention.get_query_key_value_tensors``), so a plain split
  of dimension 0 gives every rank whole groups whenever TP divides the group count, which
  validation requires.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ldt.models.arch import EXPERTS
from ldt.models.vocab import fit_rows, is_vocab_param

# suffix -> split dimension (None = replicated). ColumnParallel: output rows; RowParallel:
# input columns (its bias is added after the all-reduce, so it is replicated).
_RULES: tuple[tuple[str, Optional[int]], ...] = (
    ("embedding.word_embeddings.weight", 0),  # VocabParallelEmbedding: vocab rows
    ("embedding.position_embeddings.weight", None),
    ("self_attention.linear_qkv.weight", 0),
    ("self_attention.linear_qkv.bias", 0),
    ("self_attention.linear_proj.weight", 1),
    ("self_attention.linear_proj.bias", None),
    ("mlp.linear_fc1.weight", 0),
    ("mlp.linear_fc1.bias", 0),
    ("mlp.linear_fc2.weight", 1),
    ("mlp.linear_fc2.bias", None),
    ("mlp.router.weight", None),  # MoE router: every rank routes its own tokens
    ("linear_fc1.weight", 0),  # a MoE expert's MLP (mlp.experts.local_experts.<e>.*)
    ("linear_fc2.weight", 1),
    ("output_layer.weight", 0),
    ("eh_proj.weight", 0),  # an MTP layer's projection of [embedding; hidden] (ColumnParallel)
    ("layernorm.weight", None),
    ("layernorm.bias", None),
    ("norm.weight", None),
    ("norm.bias", None),
)


def split_dim(name: str) -> Optional[int]:
    """The dimension ``name`` is split along across TP ranks, or None if replicated."""
    for suffix, dim in _RULES:
        if name.endswith(suffix):
            return dim
    raise KeyError(
        f"no TP sharding rule for parameter {name!r}; ldt knows GPTModel with the local layer "
        "spec; add a rule to ldt/models/sharding.py for other modules"
    )


_GATED = ("linear_fc1.weight", "linear_fc1.bias")  # the dense MLP's and every expert's


def tp_of(name: str, tp: int, tp_rank: int, ep: int = 1) -> tuple[int, int]:
    """(TP size, TP rank) parameter ``name`` is split over on a stage of TP ``tp`` and expert
    parallelism ``ep``: a MoE expert's over the ``tp / ep`` ranks of its expert-TP group
    (:meth:`ldt.topology.ranks.Topology.expert_groups`), everything else over the stage's TP."""
    if ep == 1 or EXPERTS not in name:
        return tp, tp_rank
    etp = tp // ep
    return etp, tp_rank % etp


def is_gated(module: torch.nn.Module) -> bool:
    """Whether a megatron module's MLP is gated (its config's ``gated_linear_unit``)."""
    return bool(getattr(getattr(module, "config", None), "gated_linear_unit", False))


def shard(name: str, full: torch.Tensor, tp: int, tp_rank: int, *,
          gated: bool = False) -> torch.Tensor:
    """The slice of a full (TP=1) parameter that TP rank ``tp_rank`` of ``tp`` holds.
    ``gated``: the model's MLP is gated (fc1 is ``[gate; up]``, each half split alone)."""
    dim = split_dim(name)
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % (2 * tp if gated and name.endswith(_GATED) else tp):
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} not divisible by tp={tp}")
    if gated and name.endswith(_GATED):
        return torch.cat([half.chunk(tp, dim=0)[tp_rank] for half in full.chunk(2, dim=0)])
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, shards: list[torch.Tensor], *, gated: bool = False) -> torch.Tensor:
    """The full parameter from every TP rank's slice (in TP rank order)."""
    dim = split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if gated and name.endswith(_GATED):
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([*gates, *ups])
    return torch.cat(shards, dim=dim)


def shard_into(name: str, full: torch.Tensor, local_shape, tp: int, tp_rank: int, *,
               gated: bool = False) -> torch.Tensor:
    """The shard of ``full`` for a local parameter of ``local_shape``: vocabulary tensors get
    this model's padding first (a checkpoint may have been padded for other TP sizes)."""
    if is_vocab_param(name):
        full = fit_rows(name, full, local_shape[0] * tp)
    return shard(name, full, tp, tp_rank, gated=gated)


def load_full_state(module: torch.nn.Module, full: Mapping[str, torch.Tensor], tp: int,
                    tp_rank: int, rename=lambda n: n) -> None:
    """Copy a full (TP=1) state into a TP-sharded module; ``rename`` maps local -> full names."""
    gated = is_gated(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            src = shard(rename(name), full[rename(name)], tp, tp_rank, gated=gated)
            if src.shape != param.shape:
                raise ValueError(f"{name}: shard shape {tuple(src.shape)} != {tuple(param.shape)}")
            param.copy_(src)
