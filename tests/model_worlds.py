"""Worker functions for the model-family tests (run inside one ldt.launch.local world).

Every case builds its stages exactly as ``ldt-train`` does (``build_stage_models``: the
family from the ModelConfig, layout-invariant init, tying) and loads weights the way
``train.load`` does (``checkpoint.load`` with no optimizer), then runs megatron's schedules
(ldt's U-shape runtime for a U-shape) through the patched ``get_forward_backward_func``:

- ``logits``: :func:`ldt.training.logits.forward_logits` (a forward-only pass of the cluster's
  schedule whose loss function gathers the head's vocabulary shards and reports the logits);
- ``train``: one forward-backward step with labels: losses and full gradients (for TP 1/2/4);
- ``oracle``: megatron-core's own ``sharded_state_dict()`` says which slice of every global
  tensor this rank holds; it must be what ``ldt.models.sharding`` put there.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

MBS, M = 2, 2


def batches(vocab_size: int, seq: int, seed: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(M):
        tokens = torch.randint(0, vocab_size, (MBS, seq + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "position_ids": torch.arange(seq).repeat(MBS, 1)})
    return out


def _loss_step(seq: int):
    from ldt.models.build import causal_mask

    mask = causal_mask(seq)

    def forward_step(data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        if batch is None:
            return model(None, None, mask), None
        out = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.clone().detach()}

        return out, loss_func

    return forward_step


def run_case(case: dict) -> dict:
    """One topology: build, load, run; returns what this rank saw."""
    import ldt
    from ldt import patches
    from ldt.config import TrainConfig
    from ldt.models.build import global_param_name
    from ldt.models.sharding import is_gated
    from ldt.training import checkpoint
    from ldt.training.logits import forward_logits
    from ldt.training.stage import build_stage_models
    from ldt.topology.validate import validate

    model, topo = case["model"], validate(case["cluster"], case["model"])
    state = ldt.initialize_vtp(topo, timeout_s=60)
    from ldt.pipeline.forward_backward import MegatronHooks
    patches.apply(["cpu_shims", "rope_cpu", "schedules", "sequence_parallel_norms",
                   "moe_without_te"], ctx=MegatronHooks())
    from megatron.core.pipeline_parallel import get_forward_backward_func  # the patched one

    try:
        cluster = case["cluster"]  # a ClusterConfig or its dict: each stage's recompute
        stages = cluster["stages"] if isinstance(cluster, dict) else cluster.stages
        c = SimpleNamespace(model=model, train=TrainConfig(seed=99),
                            cluster=SimpleNamespace(stages=stages))
        models = build_stage_models(c, topo, state)
        chunks = topo.split.stage_chunks(state.stage)
        if case["checkpoint"]:  # else: ldt's layout-invariant init
            checkpoint.load(case["checkpoint"], models, chunks, None, state)
        from megatron.core import parallel_state as ps

        out = {"stage": state.stage, "tp_rank": state.info.tp_rank,
               "gated": is_gated(models[0]),
               # megatron's expert getters as this rank's stage answers them, and which
               # experts of each MoE layer this rank holds
               "experts": (ps.get_expert_model_parallel_world_size(),
                           ps.get_expert_model_parallel_rank(),
                           ps.get_expert_tensor_parallel_world_size(),
                           ps.get_expert_tensor_parallel_rank(),
                           ps.get_expert_data_parallel_world_size()),
               "local_experts": [list(layer.mlp.local_expert_indices) for g in models
                                 for layer in g.decoder.layers
                                 if hasattr(layer.mlp, "local_expert_indices")],
               "shapes": {global_param_name(ch, n): tuple(p.shape)
                          for ch, g in zip(chunks, models) for n, p in g.named_parameters()}}
        if case.get("oracle"):
            out["oracle"] = _oracle(case["checkpoint"], chunks, models)
        data = batches(model.vocab_size, model.seq_length)
        if case["kind"] == "logits":
            out["logits"] = forward_logits(models, data, state=state,
                                           seq_length=model.seq_length, micro_batch_size=MBS)
            return out
        reads = state.stage in topo.data_stages()
        iters = [iter(data) if reads else None for _ in models]
        store = get_forward_backward_func()(
            forward_step_func=_loss_step(model.seq_length),
            data_iterator=iters if len(models) > 1 and not topo.u_shape else iters[0],
            model=models if len(models) > 1 else models[0], num_microbatches=M,
            seq_length=model.seq_length, micro_batch_size=MBS)
        out["losses"] = [float(x["lm loss"]) for x in store]
        out["grads"] = {global_param_name(ch, n): p.grad.detach().clone()
                        for ch, g in zip(chunks, models) for n, p in g.named_parameters()
                        if p.grad is not None}
        return out
    finally:
        patches.revert()
        ldt.destroy_vtp()


def _oracle(checkpoint_path: str, chunks, models) -> list[str]:
    """Mismatches between the loaded shards and megatron's sharded_state_dict (empty: none).
    ``non_homogeneous_layers``: one key per layer, under the global layer number ldt sets."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from ldt.models.spec import canonical_name
    from ldt.models.tensor_files import read_tensors, tensor_index

    index = tensor_index(checkpoint_path)
    fulls = read_tensors(index, list(index))
    problems, seen = [], 0
    for gpt in models:
        for key, item in gpt.sharded_state_dict(metadata={"non_homogeneous_layers": True}).items():
            pieces = item.build() if isinstance(item, ShardedTensorFactory) else [item]
            for sh in pieces:
                if not isinstance(sh, ShardedTensor) or key.endswith("_extra_state"):
                    continue
                name = canonical_name(sh.key)
                full = fulls[name].float()
                if full.shape[0] < sh.global_shape[0]:  # vocabulary padding: zero rows
                    full = torch.cat([full, full.new_zeros(sh.global_shape[0] - full.shape[0],
                                                           *full.shape[1:])])
                assert tuple(full.shape) == tuple(sh.global_shape), (name, sh.global_shape)
                sl = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sh.local_shape))
                if not torch.equal(sh.data.float().reshape(full[sl].shape), full[sl]):
                    problems.append(f"{name} at offset {sh.global_offset}")
                seen += 1
    if not seen:
        problems.append("megatron's sharded_state_dict listed no tensor")
    return problems


def world(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [run_case(c) for c in cases]
