"""One rank's stage: its model chunks (built, initialized layout-invariantly, tied) and the
megatron-style ``forward_step_func`` the schedules call."""

from __future__ import annotations

import torch

from ldt.models.build import build_chunk, causal_mask, param_names
from ldt.models.init import init_chunk
from ldt.models.recompute import stage_recompute, transformer_kwargs
from ldt.models.vocab import model_vocab_size


def make_forward_step(seq_length: int, device="cpu"):
    """Megatron-style forward_step_func; stages without data get ``data_iterator=None``.
    ``device``: the stage's (the data come from the host; the mask and the batch go there)."""
    mask = causal_mask(seq_length, device)

    def forward_step(data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        if batch is None:
            return model(None, None, mask), _loss_func(None)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return out, _loss_func(batch["loss_mask"])

    return forward_step


def _loss_func(loss_mask):
    def loss_func(output_tensor):
        lm = loss_mask if loss_mask is not None else torch.ones_like(output_tensor)
        loss = (output_tensor.float() * lm).sum() / lm.sum()
        return loss, {"lm loss": loss.clone().detach()}  # clone: the schedule divides in place

    return loss_func


def build_stage_models(c, topo, state) -> list:
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(c.train.seed)
    chunks = topo.split.stage_chunks(state.stage)
    vpp = len(chunks) if len(chunks) > 1 and not topo.u_shape else None
    stage = topo.stages[state.stage]
    recompute = transformer_kwargs(stage_recompute(c.model, c.cluster.stages[state.stage]))
    models = []
    for chunk in chunks:
        gpt = build_chunk(c.model, chunk, stage.tp, device=stage.device, vpp=vpp,
                          num_stages=topo.num_stages, pg_collection=state.pg_collection(),
                          vocab_size=model_vocab_size(c.model, topo), ep=stage.ep,
                          **recompute)
        init_chunk(gpt, seed=c.train.seed, num_layers=c.model.num_layers, tp=stage.tp,
                   tp_rank=state.info.tp_rank, rename=param_names(chunk, gpt).__getitem__,
                   vocab_size=c.model.vocab_size, ep=stage.ep)
        gpt.config.overlap_p2p_comm = bool(c.train.overlap_p2p_comm and vpp)
        gpt.config.batch_p2p_comm = not gpt.config.overlap_p2p_comm
        models.append(gpt)
    if c.model.tie_embeddings and any(ch.has_embedding or ch.has_head for ch in chunks):
        tie_embeddings(chunks, models, state)
    share_mtp_embedding(chunks, models)
    return models


def share_mtp_embedding(chunks, models) -> None:
    """The MTP layers embed the next tokens with the model's input embedding. megatron-core
    gives the head's chunk its own copy (on another stage it ties it over the embedding
    group); on a U-shape's edge the embedding's chunk is on the same ranks, so the head's
    chunk uses that very module: one embedding, both gradients into it, as in a one-stage
    model (validation refuses MTP where the two are on different stages)."""
    emb = next((g for ch, g in zip(chunks, models) if ch.has_embedding), None)
    for ch, gpt in zip(chunks, models):
        if ch.num_mtp and not ch.has_embedding:
            gpt.embedding = emb.embedding


def tie_embeddings(chunks, models, state) -> None:
    """Tie the input embedding and the output head.

    On one stage (U-shape edge, one-stage model) the head chunk uses the embedding's
    parameter and both gradients accumulate into it. Across stages (plain pipeline) it is
    megatron's own scheme: the last stage keeps a copy, zeroed and then filled by an
    all-reduce over the embedding group (ldt's reshards between the two stages' TP sizes);
    the copy is marked ``shared`` (counted once in the gradient norm), and the gradients are
    summed over the same group every step (megatron's ``finalize_model_grads``, called by
    :meth:`ldt.training.optim.StageOptimizer.step`).
    """
    import torch.distributed as dist

    emb = next((g for ch, g in zip(chunks, models) if ch.has_embedding), None)
    head = next((g for ch, g in zip(chunks, models) if ch.has_head), None)
    if emb is not None and head is not None:
        head.output_layer.weight = emb.embedding.word_embeddings.weight
        return
    gpt = emb if emb is not None else head
    gpt.share_embeddings_and_output_weights = True  # megatron's flag, as with pp > 1
    weight = gpt.shared_embedding_or_output_weight()
    weight.shared_embedding = True
    with torch.no_grad():
        if emb is None:
            weight.zero_()
            weight.shared = True
        dist.all_reduce(weight.data, group=state.embd_group)
