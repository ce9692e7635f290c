"""A plain Megatron-core training loop, written the way megatron's own simple example is.

Nothing in it knows about ldt. Run it on a uniform cluster the Megatron way (torchrun, nccl,
TP x PP) or on a heterogeneous one through ldt without editing it:

    python -m ldt.job.megatron --cluster conf/cluster/cpu_vtp.yaml examples/megatron_simple_train.py --pp 3

The other activation route is one line at the top of a script (see examples/README.md):

    import ldt; ldt.activate("conf/cluster/cpu_vtp.yaml")

Every pipeline stage prints nothing; the last stage prints one line per step and, at the end,
one JSON line with the losses.
"""

import argparse
import json
import os
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, MBS, VOCAB = 32, 2, 128


def initialize_distributed(tp: int, pp: int) -> None:
    parallel_state.destroy_model_parallel()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend="nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)


def model_provider(pp: int) -> GPTModel:
    config = TransformerConfig(
        num_layers=6, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def batches(num_microbatches: int, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        yield {"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda(),
               "position_ids": torch.arange(SEQ).repeat(MBS, 1).cuda(),
               "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1).cuda()}


def loss_func(output_tensor):
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.clone().detach()}


def forward_step_func(data_iterator, model):
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], data["attention_mask"],
                   labels=data["labels"])
    return output, partial(loss_func)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    initialize_distributed(args.tp, args.pp)
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(123)
    gpt_model = model_provider(args.pp).cuda()
    optim = torch.optim.Adam(gpt_model.parameters(), lr=1e-3)
    forward_backward_func = get_forward_backward_func()

    losses = []
    for step in range(args.steps):
        optim.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=batches(args.microbatches, step),
            model=gpt_model, num_microbatches=args.microbatches, seq_length=SEQ,
            micro_batch_size=MBS, decoder_seq_length=SEQ, forward_only=False)
        optim.step()
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
            loss = sum(x["lm loss"].item() for x in losses_reduced) / len(losses_reduced)
            losses.append(loss)
            print(f"step {step} loss {loss:.6f}", flush=True)
    if losses:
        print(json.dumps({"losses": losses}), flush=True)


if __name__ == "__main__":
    main()
