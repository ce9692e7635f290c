"""Worker functions shared by the model-parity tests (run inside ldt.launch worlds).

The reference is megatron-core's own no-pipelining schedule on one process with the full
model; the VTP runs load the same full weights, sharded per stage TP size, and must give the
same loss and gradients.
"""

from __future__ import annotations

import dataclasses

import torch

from ldt.config import ModelConfig

MODEL = ModelConfig(name="parity", num_layers=6, hidden_size=64, num_attention_heads=4,
                    ffn_hidden_size=128, vocab_size=256, seq_length=16)
MBS = 2


def make_batches(m: int, seed: int = 7) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, MODEL.vocab_size, (MBS, MODEL.seq_length + 1), generator=g)
        mask = torch.ones(MBS, MODEL.seq_length)
        mask[:, -3:] = 0.0  # a loss mask that is not all ones
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": mask,
                    "position_ids": torch.arange(MODEL.seq_length).repeat(MBS, 1)})
    return out


def even_layout(num_layers: int, segments: int) -> str:
    """``E...|...|...L`` with the layers spread over ``segments`` segments."""
    counts = [num_layers // segments + (i < num_layers % segments) for i in range(segments)]
    segs = ["t" * c for c in counts]
    segs[0], segs[-1] = "E" + segs[0], segs[-1] + "L"
    return "|".join(segs)


def forward_step(data_iterator, model):
    from ldt.model import causal_mask

    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], causal_mask(MODEL.seq_length),
                labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss = (output_tensor.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.clone().detach()}

    return out, loss_func


def _setup(topo, patches_ctx=None):
    import ldt
    from ldt import patches

    state = ldt.initialize_vtp(topo, timeout_s=60)
    patches.apply(["cpu_shims", "schedules"], ctx=patches_ctx)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)  # as a Megatron script does
    return state


def _run_schedule(state, topo, full_state, m, overlap=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ldt.model import build_chunk, global_param_name
    from ldt.sharding import load_full_state

    chunks = topo.split.stage_chunks(state.stage)
    vpp = len(chunks) if len(chunks) > 1 else None
    tp = topo.stages[state.stage].tp
    models = []
    for chunk in chunks:
        gpt = build_chunk(MODEL, chunk, tp, vpp=vpp, num_stages=topo.num_stages)
        load_full_state(gpt, full_state, tp, state.info.tp_rank,
                        rename=lambda n, c=chunk: global_param_name(c, n))
        gpt.config.overlap_p2p_comm = overlap
        gpt.config.batch_p2p_comm = not overlap
        models.append(gpt)
    batches = make_batches(m)
    iters = [iter(batches) for _ in models]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if vpp else iters[0],
        model=models if vpp else models[0],
        num_microbatches=m, seq_length=MODEL.seq_length, micro_batch_size=MBS,
        forward_only=False)
    grads = {}
    for chunk, gpt in zip(chunks, models):
        for name, p in gpt.named_parameters():
            grads[global_param_name(chunk, name)] = p.grad.detach().clone()
    return [float(x["lm loss"]) for x in losses], grads


def reference(rank, world, m, seed=1234):
    """Full model on one process through megatron's no-pipelining schedule."""
    from ldt.layout import split_layers
    from ldt.model import build_chunk
    from ldt.topology import Stage, Topology

    topo = Topology((Stage(0, "ref", "cpu", 1),),
                    split=split_layers(MODEL.num_layers, 1))
    state = _setup(topo)
    torch.manual_seed(seed)
    full = {n: p.detach().clone()
            for n, p in build_chunk(MODEL, topo.split.stage_chunks(0)[0], 1).named_parameters()}
    losses, grads = _run_schedule(state, topo, full, m)
    return {"full": full, "losses": losses, "grads": grads}


def vtp_run(rank, world, topo, full_state, m, variants):
    """Run each variant ({"vpp": int, "overlap": bool, "host_staging": bool}) in one world."""
    from ldt.layout import split_layers

    import ldt
    from ldt import patches

    results = []
    for v in variants:
        layout = even_layout(MODEL.num_layers, v.get("vpp", 1) * topo.num_stages)
        t = dataclasses.replace(
            topo, split=split_layers(MODEL.num_layers, topo.num_stages, layout=layout),
            force_host_staging=v.get("host_staging", False))
        state = _setup(t)
        losses, grads = _run_schedule(state, t, full_state, m, overlap=v.get("overlap", False))
        results.append({"stage": state.stage, "tp_rank": state.info.tp_rank,
                        "losses": losses, "grads": grads})
        patches.revert()
        ldt.destroy_vtp()
    return results
