"""Layout-invariant initialization: the same initial model whatever the stages and TP sizes.

Every parameter's full (TP=1) value is drawn from a generator seeded by (seed, its global
name in the canonical naming), then sliced for this rank's TP shard (:mod:`ldt.models.sharding`,
which knows a gated MLP's ``[gate; up]`` fc1). So a VTP run, a uniform run and the
single-process reference of ``train.verify`` start from identical weights, whatever the family
and the layer implementation, and a checkpoint can be re-sharded for another layout. The
distributions are megatron-core's defaults: normal(0, init_method_std) weights, output
projections scaled by 1/sqrt(2 * num_layers), zero biases, unit norm weights.
"""

from __future__ import annotations

import hashlib
import math

from typing import Optional

import torch

from ldt.models.sharding import is_gated, shard, split_dim, tp_of
from ldt.models.vocab import fit_rows, is_vocab_param

_SCALED = ("self_attention.linear_proj.weight", "linear_fc2.weight")  # also every expert's


def full_init(name: str, shape, *, seed: int, num_layers: int, std: float = 0.02,
              dtype=torch.float32) -> torch.Tensor:
    """The full value of parameter ``name`` (global name) at initialization."""
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape, dtype=dtype)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    scale = std / math.sqrt(2.0 * num_layers) if name.endswith(_SCALED) else std
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype)


def full_shape(name: str, local: torch.Tensor, tp: int, split_dim) -> tuple:
    shape = list(local.shape)
    if split_dim is not None:
        shape[split_dim] *= tp
    return tuple(shape)


def init_chunk(module: torch.nn.Module, *, seed: int, num_layers: int, tp: int, tp_rank: int,
               rename=lambda n: n, vocab_size: Optional[int] = None, ep: int = 1) -> None:
    """Overwrite a chunk's parameters with their layout-invariant initial values.

    ``vocab_size``: the real vocabulary; the embedding and head rows beyond it (the padding,
    which depends on the layout's TP sizes) start at zero, so the real rows are the same
    whatever the padding. ``ep``: the stage's expert parallelism (``rename`` gives the
    experts their global numbers, :func:`ldt.models.build.param_names`)."""
    gated = is_gated(module)
    with torch.no_grad():
        for local_name, p in module.named_parameters():
            name = rename(local_name)
            dim = split_dim(name)
            size, rank = tp_of(name, tp, tp_rank, ep)
            shape = full_shape(name, p, size, dim)
            padded = vocab_size is not None and is_vocab_param(name) and shape[0] > vocab_size
            full = full_init(name, (vocab_size, *shape[1:]) if padded else shape, seed=seed,
                             num_layers=num_layers, dtype=p.dtype)
            if padded:
                full = fit_rows(name, full, shape[0])
            p.copy_(shard(name, full, size, rank, gated=gated))
