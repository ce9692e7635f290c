"""One rank's stage: its model chunks (built, initialized layout-invariantly, tied) and the
megatron-style ``forward_step_func`` the schedules call."""

from __future__ import annotations

import torch


def make_forward_step(seq_length: int):
    """Megatron-style forward_step_func; stages without data get ``data_iterator=None``."""
    from ldt.models.build import causal_mask

    mask = causal_mask(seq_length)

    def forward_step(data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        if batch is None:
            return model(None, None, mask), _loss_func(None)
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

    from ldt.models.init import init_chunk
    from ldt.models.build import build_chunk, global_param_name
    from ldt.models.vocab import model_vocab_size

    tensor_parallel.model_parallel_cuda_manual_seed(c.train.seed)
    chunks = topo.split.stage_chunks(state.stage)
    vpp = len(chunks) if len(chunks) > 1 and not topo.u_shape else None
    stage = topo.stages[state.stage]
    models = []
    for chunk in chunks:
        gpt = build_chunk(c.model, chunk, stage.tp, device=stage.device, vpp=vpp,
                          num_stages=topo.num_stages, pg_collection=state.pg_collection(),
                          vocab_size=model_vocab_size(c.model, topo))
        init_chunk(gpt, seed=c.train.seed, num_layers=c.model.num_layers, tp=stage.tp,
                   tp_rank=state.info.tp_rank, rename=lambda n, ch=chunk: global_param_name(ch, n),
                   vocab_size=c.model.vocab_size)
        gpt.config.overlap_p2p_comm = bool(c.train.overlap_p2p_comm and vpp)
        gpt.config.batch_p2p_comm = not gpt.config.overlap_p2p_comm
        models.append(gpt)
    if c.model.tie_embeddings and any(ch.has_embedding for ch in chunks):
        tie_embeddings(chunks, models)
    return models


def tie_embeddings(chunks, models) -> None:
    """Share the input embedding with the output head. Validation guarantees both sit on
    this stage (U-shape edge or a one-stage model), so no cross-stage group is needed: the
    head chunk just uses the embedding's parameter, and both gradients accumulate into it."""
    emb = next(g for ch, g in zip(chunks, models) if ch.has_embedding)
    head = next(g for ch, g in zip(chunks, models) if ch.has_head)
    head.output_layer.weight = emb.embedding.word_embeddings.weight
