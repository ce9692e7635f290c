"""A Megatron-core training script as its users write it; nothing in it knows about ldt.

Tied input embedding and output layer (megatron's default), megatron's
DistributedDataParallel, ``finalize_model_grads`` with per-token loss, and dist-checkpointing
save and load. Written for CUDA/NCCL and torchrun; ldt's tests run it on CPU (uniform through
megatron's own ``initialize_model_parallel``, VTP through ``python -m ldt.job.megatron``).

Writes ``--out``/rank_<r>.json: losses (last stage), the tied weight per step (first and last
stage, gathered to the full vocabulary on TP rank 0) and the checkpoint round trip's result.
"""

import argparse
import json
import os
from functools import partial

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, MBS, VOCAB, LR = 16, 2, 128, 0.05


def model_provider(pp: int, seed: int) -> GPTModel:
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=6, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        calculate_per_token_loss=True)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=True)


def batches(num_microbatches: int, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    device = torch.device("cuda")
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        mask = torch.ones(MBS, SEQ)
        mask[:, -3:] = 0.0
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                 "position_ids": torch.arange(SEQ).repeat(MBS, 1),
                 "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)}
        yield {k: v.to(device) for k, v in batch.items()}


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float() * loss_mask
    num_tokens = loss_mask.sum().to(torch.int)
    total = losses.sum()
    return total, num_tokens, {"lm loss": torch.stack([total.detach(), num_tokens.float()])}


def forward_step_func(data_iterator, model):
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], data["attention_mask"],
                   labels=data["labels"])
    return output, partial(loss_func, data["loss_mask"])


def full_tied_weight(gpt: GPTModel):
    """The shared weight of this stage, all vocabulary rows (on TP rank 0), or None."""
    if not (gpt.pre_process or gpt.post_process):
        return None
    w = gpt.shared_embedding_or_output_weight().detach()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(w) for _ in range(group.size())]
    torch.distributed.all_gather(parts, w.contiguous(), group=group)
    return torch.cat(parts).tolist() if parallel_state.get_tensor_model_parallel_rank() == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group(backend="nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    rank = torch.distributed.get_rank()
    gpt = model_provider(args.pp, seed=123).cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    forward_backward_func = get_forward_backward_func()

    record = {"losses": [], "tied": []}
    for step in range(args.steps):
        model.zero_grad_buffer()
        out = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=batches(args.microbatches, step),
            model=model, num_microbatches=args.microbatches, seq_length=SEQ,
            micro_batch_size=MBS, decoder_seq_length=SEQ, forward_only=False)
        with torch.no_grad():  # plain SGD on the reduced gradients DDP keeps in main_grad
            for p in model.parameters():
                p.sub_(LR * p.main_grad)
        record["tied"].append(full_tied_weight(gpt))
        if out:
            total = torch.stack([x["lm loss"] for x in out]).sum(0)
            record["losses"].append(float(total[0] / total[1]))

    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(gpt.sharded_state_dict(), args.ckpt)
    fresh = model_provider(args.pp, seed=999).cuda()
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), args.ckpt))
    trained = dict(gpt.named_parameters())
    record["ckpt_max_diff"] = max(
        float((p - trained[n]).detach().abs().max()) for n, p in fresh.named_parameters())
    record["ckpt_params"] = len(trained)
    with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
