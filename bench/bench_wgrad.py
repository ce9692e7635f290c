"""The zero-bubble split's own cost in one process: megatron's unsplit backward against B + W
(``patches/wgrad_split.py``, issue #42).

One GPT stage (embedding, 2 layers of hidden 256 and FFN 1024, the head and the loss; one
micro-batch of 2 x 64 tokens) trains through ldt's optimizer path (megatron's DDP) in one
process on one thread, alternating two modes, ``ROUNDS`` times each: ``unsplit`` (megatron's
layers as they are: the weight gradients inside the backward) and ``split`` (the patch
applied; each backward captured by a W store, its W run right after it). Per micro-batch,
medians over ``STEPS`` steps of ``M`` micro-batches after one warm-up step: the forward, the
backward (split: B, then W), and the minor page faults (``getrusage``). What the split adds
on this machine with no pipeline around it: no waits, no other ranks, nothing to overlap.
"""

from __future__ import annotations

import contextlib
import resource
import time

from bench.common import emit, machine_load, median

M, STEPS, ROUNDS = 4, 12, 2
MODES = ("unsplit", "split")
MODEL = dict(name="wgrad", num_layers=2, hidden_size=256, num_attention_heads=4,
             ffn_hidden_size=1024, vocab_size=256, seq_length=64)

# bench/RESULTS.md's summary rows (bench.summary): (figure, value, goal), templates over the JSON
SUMMARY = [
    ("zero-bubble split, one process and thread (2 GPT layers of hidden 256 and the head): "
     "B + W / the unsplit backward; the forward split / unsplit (medians per micro-batch)",
     "{ratio_backward:.3f}; {ratio_forward:.3f}", "-"),
]
# docs/zero_bubble.md's figure of the latest run
QUOTES = [("docs/zero_bubble.md",
           "{split[backward_ms]:.2f} ms per micro-batch against the unsplit backward's "
           "{unsplit[backward_ms]:.2f}")]


def _cfg() -> dict:
    return {"cluster": {"stages": [{"name": "s", "device": "cpu", "tp": 1}], "dp": 1},
            "model": MODEL,
            "train": {"micro_batch_size": 2, "num_microbatches": M, "clip_grad": 0.0,
                      "lr": 1e-3, "seed": 5}}


def _batches() -> list:
    import torch

    g = torch.Generator().manual_seed(7)
    s, v = MODEL["seq_length"], MODEL["vocab_size"]
    out = []
    for _ in range(M):
        tokens = torch.randint(0, v, (2, s + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "position_ids": torch.arange(s).repeat(2, 1)})
    return out


def _step(chunk, store, data, mask, times: dict) -> None:
    """One step's forwards and backwards (split: each B captured, its W right after)."""
    for mb, batch in enumerate(data):
        t0 = time.perf_counter()
        loss = chunk(batch["tokens"], batch["position_ids"], mask,
                     labels=batch["labels"]).float().mean() / M
        t1 = time.perf_counter()
        with store.capture((mb, "stage")) if store else contextlib.nullcontext():
            loss.backward()
        t2 = time.perf_counter()
        if store:
            store.run((mb, "stage"))
        t3 = time.perf_counter()
        times["forward_ms"].append((t1 - t0) * 1e3)
        times["b_ms"].append((t2 - t1) * 1e3)
        times["w_ms"].append((t3 - t2) * 1e3)
        times["backward_ms"].append((t3 - t1) * 1e3)
    if store:
        store.finish()


def _measure(rank: int, world: int) -> dict:
    import torch

    import ldt
    from ldt import patches
    from ldt.config import typed_config
    from ldt.models.build import causal_mask
    from ldt.patches.wgrad_split import WgradSeam
    from ldt.schedule.wgrad import WgradStore
    from ldt.topology.validate import validate
    from ldt.training.optim import build_stage_optimizer
    from ldt.training.stage import build_stage_models

    torch.set_num_threads(1)
    c = typed_config(_cfg())
    topo = validate(c.cluster, c.model, world_size=world, train=c.train)
    state = ldt.initialize_vtp(topo, timeout_s=60)
    names = ["cpu_shims", "optimizer_cpu"]
    patches.apply(names)
    try:
        models = build_stage_models(c, topo, state)
        opt = build_stage_optimizer(c, topo, state, models, shared_chunks=False)
        chunk, data, mask = opt.chunks[0], _batches(), causal_mask(MODEL["seq_length"])
        got: dict = {mode: {k: [] for k in ("forward_ms", "b_ms", "w_ms", "backward_ms")}
                     for mode in MODES}
        faults: dict = {mode: [] for mode in MODES}
        for _ in range(ROUNDS):
            for mode in MODES:
                with patches.applied(["wgrad_split"] if mode == "split" else []):
                    store = WgradStore(WgradSeam({"stage": chunk})) if mode == "split" else None
                    _step(chunk, store, data, mask, {k: [] for k in got[mode]})  # warm-up
                    opt.zero_grad()
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    for _ in range(STEPS):
                        _step(chunk, store, data, mask, got[mode])
                        opt.zero_grad()
                    faults[mode].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                                         - before) / (STEPS * M))
    finally:
        patches.revert(names)
        ldt.destroy_vtp()
    return {mode: {**{k: round(median(v), 3) for k, v in got[mode].items()},
                   "minor_faults_per_mb": round(median(faults[mode]), 1)} for mode in MODES}


def main() -> dict:
    from ldt.launch.local import run_local_world

    load = machine_load()
    (got,) = run_local_world(1, _measure, (), timeout_s=600, comm_timeout_s=60)
    out = {"bench": "wgrad", **got,
           "ratio_backward": got["split"]["backward_ms"] / got["unsplit"]["backward_ms"],
           "ratio_forward": got["split"]["forward_ms"] / got["unsplit"]["forward_ms"],
           "model": MODEL, "micro_batches": M, "steps": STEPS, "rounds": ROUNDS}
    print(f"unsplit: forward {got['unsplit']['forward_ms']:.2f} ms, backward "
          f"{got['unsplit']['backward_ms']:.2f} ms; split: forward {got['split']['forward_ms']:.2f}"
          f" ms, B {got['split']['b_ms']:.2f} + W {got['split']['w_ms']:.2f} = "
          f"{got['split']['backward_ms']:.2f} ms ({out['ratio_backward']:.3f} of the unsplit "
          f"backward); minor faults per micro-batch {got['unsplit']['minor_faults_per_mb']} / "
          f"{got['split']['minor_faults_per_mb']}")
    return emit(out, load_before=load)


if __name__ == "__main__":
    main()
