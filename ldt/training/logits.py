"""Logits out of a pipeline: a forward-only pass whose loss function hands the logits back.

Megatron's schedules (and ldt's U-shape runtime, which has their signature) return what the
loss stage's loss function reports, not the model's output. So the forward step here calls
each chunk without labels (GPTModel then returns logits, ``[b, s, vocab / tp]``), and its loss
function gathers the TP shards of the vocabulary and reports the full logits. It runs the
cluster's own schedule with ``forward_only=True``: the same stage boundaries, TP sizes and
U-shape wraparound as training. Used to compare ldt with ``transformers`` (tests, the SmolLM2
example) and for evaluation code that needs more than the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ldt.models.build import causal_mask


def logits_forward_step(state, seq_length: int):
    """A megatron ``forward_step_func`` reporting ``{"logits": [b, s, padded vocab]}``."""
    mask = causal_mask(seq_length)

    def forward_step(data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        if batch is None:  # a stage without data: its input comes from the previous stage
            return model(None, None, mask), None
        out = model(batch["tokens"], batch["position_ids"], mask)

        def gather_logits(output):
            parts = [torch.empty_like(output) for _ in state.stage_ranks]
            dist.all_gather(parts, output.contiguous(), group=state.tp_group)
            return output.float().sum() * 0.0, {"logits": torch.cat(parts, dim=-1).detach()}

        return out, gather_logits

    return forward_step


def forward_logits(models: list, batches: list[dict], *, state, seq_length: int,
                   micro_batch_size: int) -> list[torch.Tensor]:
    """Full logits of every micro-batch on the loss stage's ranks (``[]`` elsewhere).

    ``batches``: dicts with ``tokens`` and ``position_ids`` (``[b, s]``); every rank passes
    the same list (stages without data ignore it). Needs ldt's ``schedules`` patch applied.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    topo = state.topology
    reads = state.stage in topo.data_stages()
    iters = [iter(batches) if reads else None for _ in models]
    interleaved = len(models) > 1 and not topo.u_shape
    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=logits_forward_step(state, seq_length),
            data_iterator=iters if interleaved else iters[0],
            model=models if len(models) > 1 else models[0], num_microbatches=len(batches),
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=True)
    return [x["logits"] for x in store]
