"""Vocabulary padding: Megatron's ``make_vocab_size_divisible_by`` rule, for stages of any TP.

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp`` so every TP
rank holds an equal slice of the embedding and the head (``VocabParallelEmbedding`` needs it);
its helper (``_vocab_size_with_padding``) lives in ``megatron.training``, which the
megatron-core wheel does not ship. With a TP size per stage, the multiple must suit every stage
that holds the embedding or the head: the least common multiple of their
``make_vocab_size_divisible_by * tp``. For one TP size this is Megatron's number exactly.

Padded rows are never looked up (token ids stay below the real vocabulary) and are zero when
a checkpoint is loaded into a run whose padding is larger (:func:`fit_rows`). Megatron lets
their logits join the softmax; ldt masks them out of the loss
(:func:`ldt.models.build.build_chunk`), so the loss does not depend on the padding and a run
resumes exactly into a layout that pads differently.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    import torch

# Parameters whose dimension 0 is the (padded) vocabulary.
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def vocab_multiple(tps: Iterable[int], make_vocab_size_divisible_by: int = 128) -> int:
    """The multiple the vocabulary is padded to for stages of TP sizes ``tps``."""
    out = 1
    for tp in set(tps) or {1}:
        out = math.lcm(out, make_vocab_size_divisible_by * tp)
    return out


def padded_vocab_size(vocab_size: int, tps: Iterable[int],
                      make_vocab_size_divisible_by: int = 128) -> int:
    """``vocab_size`` rounded up to :func:`vocab_multiple` (Megatron's rule for one TP)."""
    multiple = vocab_multiple(tps, make_vocab_size_divisible_by)
    return -(-vocab_size // multiple) * multiple


def vocab_stage_tps(topo) -> list[int]:
    """TP sizes of the stages that hold the embedding or the head (a validated topology)."""
    return sorted({topo.stages[c.stage].tp for c in topo.split.model_order
                   if c.has_embedding or c.has_head})


def model_vocab_size(model, topo) -> int:
    """The padded vocabulary of ``model`` on ``topo``: what every chunk is built with."""
    return padded_vocab_size(model.vocab_size, vocab_stage_tps(topo),
                             model.make_vocab_size_divisible_by)


def is_vocab_param(name: str) -> bool:
    return name.endswith(VOCAB_PARAMS)


def fit_rows(name: str, tensor: torch.Tensor, rows: int,
             vocab_size: Optional[int] = None) -> torch.Tensor:
    """A vocabulary tensor with ``rows`` rows: zero rows appended, or padding rows dropped.

    Only padding may go: with ``vocab_size`` (the real vocabulary), dropping rows below it is
    refused (:func:`ldt.models.arch.check_shapes` checks this before a run starts).
    """
    have = tensor.shape[0]
    if vocab_size is not None and min(have, rows) < vocab_size:
        raise ValueError(f"{name}: {have} rows cannot become {rows} rows without losing part of "
                         f"the vocabulary of {vocab_size} (check model.vocab_size)")
    if have >= rows:
        return tensor[:rows]
    import torch  # here: the vocabulary's sizes are checked before a run, without torch

    return torch.cat([tensor, tensor.new_zeros((rows - have, *tensor.shape[1:]))])
