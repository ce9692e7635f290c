"""Worker functions for the sequence-parallel parity tests (run inside ldt.launch.local worlds).

Like :mod:`gpt_worlds` (same model, weights and batches), with ``sequence_parallel=True`` on
every stage of TP > 1, the partial norm / bias gradients summed over TP afterwards (what
ldt's loop does), and optionally micro-batches of different sequence lengths
(``variable_seq_lengths=True``). Each rank also reports what proves sequence parallelism was
really on: the sequence length its first decoder layer saw and how many parameters are
marked ``sequence_parallel``.
"""

from __future__ import annotations

import dataclasses

import torch

from gpt_worlds import (MBS, MODEL, AuditLog, RecomputeCount, Tripwire, _collect, _setup,
                        make_batches, recompute_kwargs, variant_topology)

SP_MODEL = dataclasses.replace(MODEL, sequence_parallel=True)


def batches(m: int, lengths=None, seed: int = 7) -> list[dict]:
    """gpt_worlds' batches, or, with ``lengths``, micro-batch i cut to ``lengths[i]`` tokens."""
    out = make_batches(m, seed)
    if lengths is None:
        return out
    return [{k: v[:, :s].contiguous() for k, v in b.items()} for b, s in zip(out, lengths)]


def forward_step(data_iterator, model):
    """gpt_worlds' forward step, with the mask sized to the micro-batch."""
    from ldt.models.build import causal_mask

    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a U-shape cloud stage: fixed length
        out = model(None, None, causal_mask(MODEL.seq_length))
        return out, None
    s = batch["tokens"].shape[1]
    out = model(batch["tokens"], batch["position_ids"], causal_mask(s), labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss = (output_tensor.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.clone().detach()}

    return out, loss_func


def _run(state, topo, full_state, m, *, sp: bool, overlap=False, lengths=None, recompute=None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ldt.models.build import build_chunk, global_param_name
    from ldt.models.sharding import load_full_state
    from ldt.testing.grads import allreduce_sequence_parallel_grads

    chunks = topo.split.stage_chunks(state.stage)
    vpp = len(chunks) if len(chunks) > 1 and not topo.u_shape else None
    tp = topo.stages[state.stage].tp
    models, seen = [], []
    for chunk in chunks:
        gpt = build_chunk(SP_MODEL if sp else MODEL, chunk, tp, vpp=vpp,
                          num_stages=topo.num_stages, **recompute_kwargs(recompute, state.stage))
        load_full_state(gpt, full_state, tp, state.info.tp_rank,
                        rename=lambda n, c=chunk: global_param_name(c, n))
        gpt.config.overlap_p2p_comm = overlap
        gpt.config.batch_p2p_comm = not overlap
        gpt.config.variable_seq_lengths = lengths is not None
        gpt.decoder.layers[0].register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(kwargs["hidden_states"].shape[0]),
            with_kwargs=True)
        models.append(gpt)
    data = batches(m, lengths)
    if topo.u_shape:
        iters = iter(data) if state.stage == 0 else Tripwire()
    else:
        iters = [iter(data) for _ in models] if vpp else iter(data)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters,
        model=models if len(models) > 1 else models[0], num_microbatches=m,
        seq_length=MODEL.seq_length, micro_batch_size=MBS)
    allreduce_sequence_parallel_grads(models, state.tp_group)
    marked = sum(getattr(p, "sequence_parallel", False) for g in models for p in g.parameters())
    return (*_collect(chunks, models, losses), seen, marked)


def reference(rank, world, m, lengths=None, seed=1234):
    """gpt_worlds' reference: the full model on one process (no sequence parallelism)."""
    from ldt.config.layout import split_layers
    from ldt.models.build import build_chunk
    from ldt.topology.ranks import Stage, Topology

    topo = Topology((Stage(0, "ref", "cpu", 1),), split=split_layers(MODEL.num_layers, 1))
    state = _setup(topo)
    torch.manual_seed(seed)
    full = {n: p.detach().clone()
            for n, p in build_chunk(MODEL, topo.split.stage_chunks(0)[0], 1).named_parameters()}
    losses, grads, _, _ = _run(state, topo, full, m, sp=False, lengths=lengths)
    return {"full": full, "losses": losses, "grads": grads}


def vtp_run(rank, world, topo, full_state, m, variants):
    """Each variant ({"sp": bool, "vpp": int, "overlap": bool, "lengths": list,
    "host_staging": bool, "recompute": see gpt_worlds.recompute_kwargs}) in one world."""
    import ldt
    from ldt import patches

    results = []
    for v in variants:
        t = variant_topology(topo, v)
        audit = AuditLog()
        state = _setup(t, observers=[audit])
        patches.apply(["sequence_parallel_norms"])
        with RecomputeCount() as recomputed:
            losses, grads, seen, marked = _run(state, t, full_state, m, sp=v.get("sp", True),
                                               overlap=v.get("overlap", False),
                                               lengths=v.get("lengths"),
                                               recompute=v.get("recompute"))
        results.append({"stage": state.stage, "tp_rank": state.info.tp_rank,
                        "tp": t.stages[state.stage].tp, "losses": losses, "grads": grads,
                        "sent": audit.sent, "seen": seen, "marked": marked,
                        "recomputed": recomputed.calls})
        patches.revert()
        ldt.destroy_vtp()
    return results


def functional_api(rank, world, topo, seq: int):
    """The reference API (vtp_send_* / vtp_recv_*) on raw tensors, stage 0 of TP 2 with
    sequence parallelism -> stage 1 of TP 1, with ``variable_seq_lengths``: rank r of stage 0
    holds rows [r*seq/2, (r+1)*seq/2) of ``whole``; stage 1 must receive ``whole`` (the
    schedule's shape says 8 rows, the message ``seq``) and send back 2 * whole, which stage 0
    must receive as its own rows."""
    from types import SimpleNamespace

    import ldt
    from ldt.p2p import vtp_recv_backward, vtp_recv_forward, vtp_send_backward, vtp_send_forward

    state = ldt.initialize_vtp(topo, timeout_s=60)
    sp = topo.stages[state.stage].tp > 1
    config = SimpleNamespace(pipeline_dtype=torch.float32, sequence_parallel=sp,
                             variable_seq_lengths=True, virtual_pipeline_model_parallel_size=None)
    whole = torch.arange(seq * 2 * 4, dtype=torch.float32).reshape(seq, 2, 4)
    try:
        if state.stage == 0:
            mine = whole.chunk(2)[state.info.tp_rank]
            sends = vtp_send_forward(mine.clone(), config) or []  # None off the leader
            got = vtp_recv_backward((4, 2, 4), config)
            for handle in sends:
                handle.wait()
            return bool(torch.equal(got, 2 * mine))
        got = vtp_recv_forward((8, 2, 4), config)
        for handle in vtp_send_backward(2 * got.detach(), config) or []:
            handle.wait()
        return bool(torch.equal(got, whole))
    finally:
        ldt.destroy_vtp()
