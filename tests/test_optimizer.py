"""megatron-core's DDP + optimizer over VTP stages against the single-process reference.

Every run is ``train_worker`` in a local world started from this process (one forkserver for
all), fp32 runs on a global batch of 8 sequences (dp * num_microbatches * micro_batch_size) so
one reference serves every layout. What must hold:

- fp32: losses, logged gradient norms (each step: the global norm over every stage, TP
  duplicates once), the first step's gradients (element by element, before Adam) and the
  trained weights equal the reference's, with and without the distributed optimizer, dp 1
  and 2, VTP and U-shape; clipping is active (norm > clip_grad). The weights within a bound
  derived from Adam (``_adam_bound``): not a fixed 1e-5 for a weight whose gradient is at
  fp32 rounding level, which Adam moves by up to lr either way the rounding falls;
- a resume from a dp 2 distributed-optimizer checkpoint into a dp 1 U-shape continues exactly;
- bf16 with fp32 main params follows a single-process bf16 run (BF16_TOL) and stays closer to
  the fp32 curve than bf16 without main params;
- combinations megatron-core refuses are refused before any process starts.
"""

from __future__ import annotations

import csv
import os

import pytest
import torch

from ldt.launch.local import run_local_world
from ldt.config import typed_config
from ldt.job.prepare import reference_config
from ldt.training.loop import train_worker

STEPS = 3
PARITY = 1e-5  # losses, and weights beyond _adam_bound's allowance, fp32
NORM_RTOL = 1e-6  # logged gradient norm, fp32
# |grad(run) - grad(reference)| <= GRAD_RTOL * max|grad(reference)|, per tensor, element by
# element, at the first step (the same weights on both sides, so only rounding differs). The
# run sums the same fp32 products in another order (TP splits the matmuls' reductions and
# all-reduces partial sums; DP all-reduces micro-batches' sums), and fp32 rounds each sum to
# its unit roundoff u = 2**-24 = 6e-8 of the terms' magnitude, which the tensor's largest
# gradient bounds from below: an element that cancels to near 0 keeps the error of its
# terms, so the error is relative to the tensor, not to the element. Measured 3.4e-7
# (vtp_2_1_2 on the epoch-ordered batches); 1e-5 leaves 30x. A wrong boundary slice or a
# micro-batch lost changes gradients by O(1) of the tensor's scale.
GRAD_RTOL = 1e-5
CLIP = 0.5
BF16_STEPS = 30
# |loss(bf16 VTP) - loss(bf16 single process)|, max over 30 steps: TP splits the bf16 matmuls
# and sums differently, so the curves part by rounding. A bf16 ulp of the logits (|x| in
# [4, 8)) is 2**-5 = 3.1e-2; allow a third of it. Measured 4e-4 at the curve test's lr 2e-3.
# That holds only where training does not amplify rounding: at lr 5e-3 without clipping the
# curves part by 1.3e-2 to 4.9e-2 after step 20 (the epoch-ordered batches), and so does the
# single-process run with its batch in other micro-batches (same math, other rounding), so
# the curve test checks that twin against the same tolerance (BF16_TWIN).
BF16_TOL = 1e-2
BF16_LR = 2e-3
# |grad(bf16 VTP) - grad(bf16 single process)| <= BF16_GRAD_RTOL * max|grad|, per tensor,
# element by element, at the first step (the same weights): bf16's products and sums, rounded
# in another order, part by a few bf16 ulps of the tensor's largest gradient (2**-8 = 3.9e-3).
# The curves alone miss a broken gradient: with one TP rank's fc1 shard given no gradient,
# the losses moved by 2.2e-3, within BF16_TOL, while that shard's gradient is all wrong (1.0).
BF16_GRAD_RTOL = 5e-2
MODEL = dict(name="gpt_tiny", num_layers=4, hidden_size=64, num_attention_heads=4,
             ffn_hidden_size=128, vocab_size=256, seq_length=32)


def _cfg(tps, *, dp=1, u_shape=False, layout=None, model=None, steps=STEPS, **train):
    """``dp``: replicas of the pipeline, or a list of them per stage (VDP)."""
    per_stage = dp if isinstance(dp, list) else [None] * len(tps)
    top = max(dp) if isinstance(dp, list) else dp
    return {"cluster": {"stages": [{"name": f"s{i}", "device": "cpu", "tp": t, "dp": d}
                                   for i, (t, d) in enumerate(zip(tps, per_stage))],
                        "u_shape": u_shape, "dp": 1 if isinstance(dp, list) else dp,
                        "layout": layout},
            "model": {**MODEL, **(model or {})},
            "train": {"steps": steps, "micro_batch_size": 2, "num_microbatches": 4 // top,
                      "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 1, "clip_grad": CLIP,
                      "comm_timeout_s": 60, "tensorboard": False, "save_every": steps, **train},
            "data": {"max_bytes": 300_000}}


def _train(cfg, run_dir) -> list[dict]:
    cfg = typed_config(cfg)
    world = sum(s.tp * (s.dp or cfg.cluster.dp) for s in cfg.cluster.stages)
    run_local_world(world, train_worker, (cfg, str(run_dir)), timeout_s=300, comm_timeout_s=60)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return [{k: float(r[k]) for k in ("loss", "grad_norm", "lr")} for r in csv.DictReader(f)]


def _weights(run_dir) -> dict:
    from ldt.models.tensor_files import read_tensors, tensor_index

    index = tensor_index(str(run_dir))
    return read_tensors(index, list(index))


def _adam_state(run_dir, step: int) -> dict:
    """``{name: (exp_avg, exp_avg_sq)}`` of the checkpoint of ``step`` (0-based), full
    tensors as the run saved them (gathered over DP and TP)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ldt.storage import checkpoint_files as files
    from ldt.storage.checkpoint_files import step_dir

    found, out = step_dir(str(run_dir), step), {}
    for part in files.parts(found):
        reader = FileSystemReader(os.path.join(found, part))
        meta = reader.read_metadata().state_dict_metadata
        sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
              if k.startswith("optim.") and k.endswith((".exp_avg", ".exp_avg_sq"))}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(sd, storage_reader=reader, no_dist=True,
                     planner=DefaultLoadPlanner(allow_partial_load=True))
        for k, v in sd.items():
            name, kind = k[len("optim."):].rsplit(".", 1)
            out.setdefault(name, {})[kind] = v
    return {n: (st["exp_avg"], st["exp_avg_sq"]) for n, st in out.items()}


def _gradients(states: list, beta1: float) -> dict:
    """Each step's (clipped) gradients from the Adam moments saved after each step:
    ``m_t = beta1 * m_(t-1) + (1 - beta1) * g_t``, so ``g_t = (m_t - beta1 * m_(t-1)) /
    (1 - beta1)``; ``{name: [g_1, g_2, ...]}``."""
    out = {}
    for name in states[0]:
        prev, out[name] = torch.zeros_like(states[0][name][0]), []
        for st in states:
            out[name].append((st[name][0] - beta1 * prev) / (1 - beta1))
            prev = st[name][0]
    return out


def _adam_bound(states: list, grads: dict, lrs: list, opt) -> dict:
    """Per element, how far the run's weight may lie from the reference's after the steps of
    ``states`` (the reference's Adam moments after each step) from gradient rounding alone.

    Adam steps a weight by ``lr_t * d_t``, ``d_t = m^_t / (sqrt(v^_t) + eps)`` (bias-corrected
    moments). Let every gradient so far differ from the reference's by at most ``delta_t``
    (GRAD_RTOL times the tensor's largest gradient so far, as the first step's check shows).
    ``m^_t`` is an average of the gradients (bias-corrected weights summing to 1), so it moves
    by at most ``delta_t``; ``sqrt(v^_t)`` is a weighted 2-norm of them, which moves by at most
    ``delta_t`` too; and ``|m^_t| <= sqrt(v^_t)`` (Cauchy-Schwarz: 1.002 for these betas and
    three steps), so ``d_t`` moves by at most ``2 * delta_t / (sqrt(v^_t) + eps)``, and
    ``|d_t| <= 1`` on either side caps the move at 2. Summed over the steps:

        bound = sum_t lr_t * min(2, 2 * delta_t / (sqrt(v^_t) + eps))

    A weight with a gradient well above rounding gets next to nothing (``sqrt(v^)`` >>
    ``delta``); one whose gradient is at rounding level (it cancels to ~0 over the batch)
    gets up to ``2 * lr_t`` a step, which is what Adam can do to it either way the rounding
    falls. Weight decay moves both sides alike (``lr * wd * w``, the same ``w`` to 1e-5), and
    a weight whose gradients so far were exactly 0 gets nothing."""
    b1, b2, eps = opt.adam_beta1, opt.adam_beta2, opt.adam_eps
    out = {}
    for name, gs in grads.items():
        bound, scale = torch.zeros_like(gs[0]), 0.0
        for t, (st, g, lr) in enumerate(zip(states, gs, lrs), start=1):
            scale = max(scale, g.abs().max().item())
            delta = GRAD_RTOL * scale
            v_hat = st[name][1] / (1 - b2 ** t)
            # a weight no token reached so far (moments exactly 0: the embedding row of a byte
            # no batch held) has no rounding to amplify: Adam leaves it alone on both sides
            bound += torch.where(v_hat > 0, lr * torch.clamp(2 * delta / (v_hat.sqrt() + eps),
                                                             max=2.0), 0.0)
        out[name] = bound
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Saved after every step: each step's Adam moments give ``_adam_bound`` its gradients."""
    folder = tmp_path_factory.mktemp("reference")
    rows = _train(reference_config(_cfg([1], save_every=1)), folder)
    return rows, _weights(folder), folder


FP32_RUNS = {  # name: (TP per stage, dp, U-shape, train overrides)
    "vtp_2_1_2": ([2, 1, 2], 1, False, {}),
    "vtp_2_1_2_distopt": ([2, 1, 2], 1, False, {"distributed_optimizer": True}),
    "vtp_1_2_dp2_distopt_overlap": ([1, 2], 2, False, {"distributed_optimizer": True,
                                                         "overlap_grad_reduce": True,
                                                         "ddp_bucket_size": 20000}),
    "ushape_1_2_1": ([1, 2, 1], 1, True, {}),
    "ushape_1_1_1_dp2": ([1, 1, 1], 2, True, {}),
    "vtp_1_2_dp2_tied": ([1, 2], 2, False, {}),
    "vtp_1_2_1_dp2_distopt_tied": ([1, 2, 1], 2, False, {"distributed_optimizer": True}),
    "ushape_1_1_dp2_distopt_tied": ([1, 1], 2, True, {"distributed_optimizer": True,
                                                      "overlap_grad_reduce": True}),
    # per-stage DP (VDP): the gradient factor after megatron's reduce, one norm per stage
    "vdp_ushape_edge1_cloud2": ([1, 1], [1, 2], True, {}),
    "vdp_ushape_edge1_cloud2_distopt_overlap": ([1, 1], [1, 2], True, {
        "distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 20000}),
    "vdp_plain_dp2_1_tp1_2": ([1, 2], [2, 1], False, {}),
}


# these runs recompute activations (megatron's, per stage; docs/memory.md): the same run, so
# the same reference. name: (model-wide settings, {stage: cluster.stages[i].recompute})
RECOMPUTE = {
    "vtp_2_1_2_distopt": ({"recompute_granularity": "selective",
                           "recompute_modules": ["core_attn", "layernorm"]}, {}),
    "ushape_1_2_1": ({}, {0: {"granularity": "full", "method": "uniform", "num_layers": 1},
                          1: {"granularity": "full", "method": "block", "num_layers": 1}}),
    "vdp_ushape_edge1_cloud2_distopt_overlap": ({}, {0: {"granularity": "full",
                                                         "method": "block", "num_layers": 1}}),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FP32_RUNS))
def test_fp32_equals_single_process_reference(name, reference, tmp_path):
    tps, dp, u_shape, train = FP32_RUNS[name]
    model = {"tie_embeddings": True} if name.endswith("tied") else None
    cfg = _cfg(tps, dp=dp, u_shape=u_shape, model=model, save_every=1, **train)
    model_wide, per_stage = RECOMPUTE.get(name, ({}, {}))
    cfg["model"].update(model_wide)
    for i, settings in per_stage.items():
        cfg["cluster"]["stages"][i]["recompute"] = settings
    if model:  # the reference of a tied model is its own
        ref_dir = tmp_path / "reference"
        ref_rows = _train(reference_config(cfg), ref_dir)
        ref_weights = _weights(ref_dir)
    else:
        ref_rows, ref_weights, ref_dir = reference
    rows = _train(cfg, tmp_path / "run")
    for got, want in zip(rows, ref_rows, strict=True):
        assert abs(got["loss"] - want["loss"]) < PARITY, (rows, ref_rows)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=NORM_RTOL), (rows,
                                                                                      ref_rows)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
    assert max(r["grad_norm"] for r in rows) > CLIP  # clipping changed the update
    opt = typed_config(cfg).train.optimizer
    ref_states = [_adam_state(ref_dir, t) for t in range(STEPS)]
    ref_grads = _gradients(ref_states, opt.adam_beta1)
    # the first step's gradients, element by element: the same weights on both sides
    run_grads = _gradients([_adam_state(tmp_path / "run", 0)], opt.adam_beta1)
    assert "embedding.word_embeddings.weight" in run_grads
    for n, (g,) in run_grads.items():
        # a tied model's head on the last stage: its gradient is the embedding's (all-reduced)
        want = ref_grads[n if n in ref_grads or not model else
                         "embedding.word_embeddings.weight"][0]
        assert (g - want).abs().max().item() <= GRAD_RTOL * want.abs().max().item(), n
    # the weights after STEPS Adam steps: PARITY, plus what Adam makes of gradient rounding
    bound = _adam_bound(ref_states, ref_grads, [r["lr"] for r in ref_rows], opt)
    weights = _weights(tmp_path / "run")
    if model:  # the tied head (the last stage's copy, or the edge's same tensor) is saved too
        weights["embedding.word_embeddings.weight (as the head)"] = weights.pop(
            "output_layer.weight")
    assert set(weights) - {"embedding.word_embeddings.weight (as the head)"} == set(ref_weights)
    worst = {}
    for n, w in weights.items():
        ref_name = n.split(" ")[0]
        excess = (w - ref_weights[ref_name]).abs() - bound[ref_name]
        worst[n] = excess.max().item()
        assert worst[n] < PARITY, (n, worst[n])
    print(f"{name}: max |dw| - adam bound {max(worst.values()):.2e} (< {PARITY})")


@pytest.mark.timeout(600)
def test_resume_from_a_sharded_optimizer_into_another_layout_and_dp(reference, tmp_path):
    """A dp 2 distributed-optimizer run saves after step 2 (main params and Adam moments
    gathered over DP and TP); a dp 1 U-shape resumes and its step 3 is the reference's."""
    from ldt.storage.checkpoint_files import step_dir

    _train(_cfg([1, 2], dp=2, steps=STEPS, save_every=2, distributed_optimizer=True),
           tmp_path / "first")
    # its step 2 (index 1); the run saved its last step too
    resumed = _cfg([1, 2, 1], u_shape=True, steps=STEPS,
                   resume=step_dir(str(tmp_path / "first"), 1))
    rows = _train(resumed, tmp_path / "second")
    ref_rows, _, _ = reference
    assert len(rows) == 1
    assert abs(rows[0]["loss"] - ref_rows[2]["loss"]) < PARITY, (rows, ref_rows)
    assert rows[0]["grad_norm"] == pytest.approx(ref_rows[2]["grad_norm"], rel=NORM_RTOL)


@pytest.mark.timeout(600)
def test_tied_ushape_resumes_exactly(tmp_path):
    """The edge's head is the embedding's parameter (one DDP buffer for the stage): saved
    under both names, its optimizer state once; a resume continues the run exactly."""
    cfg = _cfg([1, 1], u_shape=True, model={"tie_embeddings": True}, save_every=2,
               distributed_optimizer=True)
    first = _train(cfg, tmp_path / "first")
    resumed = _train({**cfg, "train": {**cfg["train"], "resume": str(tmp_path / "first" /
                                                                      "checkpoints" /
                                                                      "step_0000001")}},
                     tmp_path / "second")
    assert [r["loss"] for r in resumed] == pytest.approx([first[2]["loss"]], abs=1e-6)


@pytest.mark.timeout(900)
def test_bf16_main_params_follow_the_single_process_bf16_curve(tmp_path):
    """No clipping: megatron-core clips only fp32 gradients, which bf16 without main params
    does not have. The first step's gradients agree element by element (BF16_GRAD_RTOL). The single-process run's twin (its batch in 8 micro-batches of 1 instead
    of 4 of 2: the same math, other bf16 rounding) must follow it within BF16_TOL too: if it
    does not, the setting amplifies rounding (see BF16_TOL) and the VTP comparison means
    nothing, whatever the VTP run did."""
    small = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "seq_length": 16}

    def curve(tps, folder, main=None, train=None, **model):
        cfg = _cfg(tps or [1], model={**small, **model}, steps=BF16_STEPS, save_every=BF16_STEPS,
                   clip_grad=0.0, lr=BF16_LR, min_lr=BF16_LR, warmup_steps=0,
                   fp32_main_params=main, **(train or {}))
        if tps is None:
            cfg = reference_config(cfg)
        return [r["loss"] for r in _train(cfg, tmp_path / folder)]

    def first_gradients(tps, folder):
        cfg = _cfg(tps or [1], model={**small, "params_dtype": "bfloat16"}, steps=1,
                   save_every=1, clip_grad=0.0, lr=BF16_LR, min_lr=BF16_LR, warmup_steps=0)
        _train(reference_config(cfg) if tps is None else cfg, tmp_path / folder)
        beta1 = typed_config(cfg).train.optimizer.adam_beta1
        return {n: g for n, (g,) in _gradients([_adam_state(tmp_path / folder, 0)],
                                               beta1).items()}

    want, got = first_gradients(None, "ref_grads"), first_gradients([2, 1], "vtp_grads")
    assert set(got) == set(want)
    worst = max((got[n] - want[n]).abs().max().item() / want[n].abs().max().item()
                for n in want)
    print(f"bf16 VTP first gradients: {worst:.2e} of each tensor's largest at most")
    assert worst <= BF16_GRAD_RTOL, worst
    fp32 = curve(None, "fp32")
    ref = curve(None, "ref_bf16", params_dtype="bfloat16")
    twin = curve(None, "twin_bf16", train={"micro_batch_size": 1, "num_microbatches": 8},
                 params_dtype="bfloat16")
    vtp = curve([2, 1], "vtp_bf16", params_dtype="bfloat16")
    no_main = curve(None, "no_main", main=False, params_dtype="bfloat16")  # Adam on bf16 weights
    W = {k: _weights(tmp_path / k) for k in ("ref_bf16", "twin_bf16", "vtp_bf16", "fp32")}
    for name in W["ref_bf16"]:
        r = W["ref_bf16"][name].float()
        sc = r.abs().max().item()
        dt = (W["twin_bf16"][name].float() - r).abs().max().item() / sc
        dv = (W["vtp_bf16"][name].float() - r).abs().max().item() / sc
        df = (W["fp32"][name].float() - r).abs().max().item() / sc
        print("W", name, f"{dt:.2e} {dv:.2e} {df:.2e} {dv / max(dt, 1e-12):.2f}")
    noise = max(abs(a - b) for a, b in zip(twin, ref))
    diff = max(abs(a - b) for a, b in zip(vtp, ref))
    dist_main = max(abs(a - b) for a, b in zip(vtp, fp32))
    dist_no_main = max(abs(a - b) for a, b in zip(no_main, fp32))
    print(f"bf16 VTP vs single-process bf16: {diff:.2e} (its micro-batch twin {noise:.2e}); "
          f"from fp32: main params {dist_main:.2e}, none {dist_no_main:.2e}")
    assert noise < BF16_TOL, ("the setting amplifies bf16 rounding", twin, ref)
    assert diff < BF16_TOL, (vtp, ref)
    assert dist_main < dist_no_main, (fp32, vtp, no_main)
    assert vtp[-1] < vtp[0] - 0.3  # it learns


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_ushape_follows_the_reference(dtype, tmp_path):
    """The U-shape's last pipeline stage is a cloud stage: it must send 16-bit activations
    on to the edge, not megatron's fp32 last-stage output (fp16 crashed on it)."""
    small = {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "seq_length": 16,
             "params_dtype": dtype}
    cfg = _cfg([1, 2, 1], u_shape=True, model=small, save_every=0)
    rows = _train(cfg, tmp_path / "run")
    ref = _train(reference_config(cfg), tmp_path / "ref")
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, ref, strict=True)) < BF16_TOL


FP16 = {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "seq_length": 16,
        "params_dtype": "float16"}


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """A 6-step fp16 U-shape run from loss scale 2^20 (3-4 steps overflow), checkpointed after
    step 2: (config, run folder, its metrics.csv rows)."""
    cfg = _cfg([1, 2, 1], u_shape=True, model=FP16, steps=6, save_every=3,
               initial_loss_scale=2.0 ** 20)
    run_dir = tmp_path_factory.mktemp("fp16") / "run"
    return cfg, run_dir, _metrics(cfg, run_dir)


@pytest.mark.timeout(600)
def test_fp16_steps_that_overflow_are_skipped_and_the_run_goes_on(fp16_run, tmp_path):
    """float16's dynamic loss scale finds its level by overflowing: megatron skips such a step
    and halves the scale (after 2 overflows). ldt stopped the run at the first one ("non-finite
    gradient norm"). Now the run goes on: metrics.csv says which steps were skipped and at
    which scale, a skipped step leaves the lr where it was, and the losses follow the
    single-process reference, which skips the same steps (the found-inf flag spans every
    stage). A constant scale cannot back off: there an overflow stops the run."""
    cfg, _, rows = fp16_run
    ref = _metrics(reference_config(cfg), tmp_path / "ref")
    skipped = [int(r["skipped"]) for r in rows]
    assert skipped == [int(r["skipped"]) for r in ref] and 0 < sum(skipped) < len(rows)
    assert [float(r["loss_scale"]) for r in rows] == [float(r["loss_scale"]) for r in ref]
    assert float(rows[-1]["loss_scale"]) < 2.0 ** 20
    for before, after in zip(rows, rows[1:]):  # the lr schedule advances on applied steps only
        assert (float(after["lr"]) == float(before["lr"])) == bool(int(before["skipped"]))
    assert max(abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(rows, ref)) < BF16_TOL


@pytest.mark.timeout(600)
def test_fp16_resumes_at_its_loss_scale_and_lr_from_a_checkpoint_and_a_snapshot(fp16_run,
                                                                              tmp_path,
                                                                              host_memory):
    """A resumed fp16 run continues at the dynamic loss scale (and its growth and hysteresis
    counts) and the lr schedule the run stood at: skipped steps did not advance the schedule.
    Resumed from the checkpoint of step 2, and from the snapshot of step 2 in host memory,
    steps 3-5 skip, scale and step as the uninterrupted run's (before, both restarted at the
    initial scale 2^20 with the schedule at the step number)."""
    shm = host_memory
    cfg, whole_dir, whole = fp16_run
    from_checkpoint = _metrics({**cfg, "train": {**cfg["train"], "resume": str(
        whole_dir / "checkpoints" / "step_0000002")}}, tmp_path / "resumed")
    cut = typed_config({**cfg, "train": {**cfg["train"], "steps": 3, "save_every": 100,
                                         "snapshot_dir": str(shm)}})
    run_local_world(4, _train_then_stop_keeping_snapshots, (cut, str(tmp_path / "run")),
                    timeout_s=300, comm_timeout_s=60)
    from_snapshot = _metrics({**cfg, "train": {**cfg["train"], "save_every": 100,
                                               "snapshot_dir": str(shm)}}, tmp_path / "run")
    later = [r for r in whole if int(r["step"]) >= 3]
    # what the checkpoint must carry: the scale moved and the schedule stands behind the step
    # number (megatron 0.16 skips steps 0-3 here, 0.17+ steps 0-2)
    assert float(later[0]["loss_scale"]) < 2.0 ** 20
    assert any(int(r["skipped"]) for r in whole if int(r["step"]) < 3)
    for rows in (from_checkpoint, from_snapshot):
        rows = [r for r in rows if int(r["step"]) >= 3]
        for key in ("step", "skipped", "loss_scale", "lr"):
            assert [r[key] for r in rows] == [r[key] for r in later], (key, rows, later)
        assert [float(r["loss"]) for r in rows] == pytest.approx(
            [float(r["loss"]) for r in later], abs=1e-5)


def test_only_an_overflow_the_scale_can_back_off_from_goes_on():
    """The norm the ranks check: none for a step the dynamic scale skipped above its smallest
    scale; NaN for one at the smallest, at a constant scale, or of an applied step."""
    import dataclasses
    import math

    from ldt.config import TrainConfig
    from ldt.training.loop import _checked_norm

    t, row = TrainConfig(), {"grad_norm": float("nan"), "skipped": 1, "loss_scale": 1024.0}
    assert _checked_norm(row, t) == 0.0
    assert math.isnan(_checked_norm({**row, "loss_scale": 1.0}, t))  # megatron's smallest
    assert math.isnan(_checked_norm(row, dataclasses.replace(t, loss_scale=1024.0)))
    assert math.isnan(_checked_norm({**row, "skipped": 0}, t))
    assert math.isnan(_checked_norm({"grad_norm": float("nan")}, t))  # bf16: no scale


def _metrics(cfg, run_dir) -> list[dict]:
    _train(cfg, run_dir)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("model,train,words", [
    ({"params_dtype": "float16"}, {"fp32_main_params": False}, "fp32_main_params=true"),
    ({"params_dtype": "bfloat16"}, {"fp32_main_params": False, "distributed_optimizer": True},
     "always shards fp32 main params"),
    ({"params_dtype": "bfloat16"}, {"loss_scale": 1024.0}, "only for float16"),
    ({"params_dtype": "bfloat16"}, {"initial_loss_scale": 1024.0}, "first scale of float16's"),
    ({"params_dtype": "float16"}, {"loss_scale": 8.0, "initial_loss_scale": 1024.0},
     "remove it or train.loss_scale"),
    ({"params_dtype": "bfloat16"}, {"fp32_main_params": False}, "clips only fp32 gradients"),
    ({}, {"optimizer": {"name": "lamb"}}, "train/optimizer=adam"),
    ({"tie_embeddings": True}, {"distributed_optimizer": True}, "same TP size"),
])
def test_refused_before_any_process(model, train, words):
    from ldt.config import ConfigError
    from ldt.topology.validate import validate

    cfg = _cfg([1, 2], dp=2, model=model, **train)
    with pytest.raises(ConfigError, match=words):
        validate(cfg["cluster"], cfg["model"], train=cfg["train"])


def _train_then_stop_keeping_snapshots(rank, world, cfg, run_dir, slow_copy_of=None):
    """``train_worker`` whose ranks end like killed ones as far as snapshots go: the last
    step's snapshot stays in host memory (a finished run would remove it). With
    ``slow_copy_of``, the writer thread copies that step's state 2 s late, long after the
    next step's forward and backward: only the loop's wait before the optimizer step
    (``Snapshots.copied``) keeps that step's update out of the snapshot."""
    import time

    from ldt.training import snapshot

    snapshot.Snapshots.close = lambda self, finished: self._thread and self._thread.join()
    if slow_copy_of is not None:
        taken_state = snapshot.taken_state

        def late(models, chunks, optimizer, step, run_state, **kw):
            if step == slow_copy_of:
                time.sleep(2.0)
            return taken_state(models, chunks, optimizer, step, run_state, **kw)

        snapshot.taken_state = late
    return train_worker(rank, world, cfg, run_dir)


@pytest.mark.timeout(600)
def test_a_bf16_distributed_optimizer_run_continues_exactly_from_its_snapshot(tmp_path,
                                                                            host_memory):
    """Snapshots hold each rank's own state as it is (train.snapshot_dir): a bf16 run with fp32
    main params, the distributed optimizer over DP 2 and a tied U-shape edge, whose ranks stop
    after step 1 leaving their snapshots, continues from them with the uninterrupted run's
    losses, gradient norms and weights, bit for bit (the same ranks, the same state). The
    snapshot of step 1 is copied 2 s late, while step 2 trains, and the run continues from it
    (step 2's is removed): step 2's optimizer step must wait for that copy."""
    import glob
    import shutil

    shm = host_memory
    cfg = _cfg([1, 1], dp=2, u_shape=True, steps=4, save_every=4, distributed_optimizer=True,
               model={"params_dtype": "bfloat16", "tie_embeddings": True},
               lr=1e-3, min_lr=1e-3, warmup_steps=0)  # the same lr in a run of 3 steps
    whole = _train(cfg, tmp_path / "whole")
    cut = typed_config({**cfg, "train": {**cfg["train"], "steps": 3,
                                         "snapshot_dir": str(shm)}})
    run_local_world(4, _train_then_stop_keeping_snapshots, (cut, str(tmp_path / "run"), 1),
                    timeout_s=300, comm_timeout_s=60)
    assert len(glob.glob(f"{shm}/**/step_0000001/rank_*", recursive=True)) == 4, \
        "the stopped run left no snapshot of step 1"
    for newer in glob.glob(f"{shm}/**/step_0000002", recursive=True):
        shutil.rmtree(newer)
    rows = _train({**cfg, "train": {**cfg["train"], "snapshot_dir": str(shm)}}, tmp_path / "run")
    assert len(rows) == 4  # steps 0-1 of the first run, 2-3 from its snapshot of step 1
    assert rows[2:] == whole[2:], (rows, whole)
    weights, want = _weights(tmp_path / "run"), _weights(tmp_path / "whole")
    assert all(torch.equal(weights[n], want[n]) for n in want)


@pytest.mark.timeout(600)
def test_a_snapshot_every_two_steps_is_taken_after_every_second_step_and_continued_from(
        tmp_path, host_memory):
    """``train.snapshot_every=2``: the ranks snapshot after steps 1 and 3 of a run of 5 (none
    after 0, 2 or 4), and a start in the run folder continues from the snapshot of step 3
    with the uninterrupted run's losses, bit for bit: the steps after it are trained again."""
    import glob
    import shutil

    shm = host_memory
    cfg = _cfg([1, 1], u_shape=True, steps=6, save_every=6, lr=1e-3, min_lr=1e-3,
               warmup_steps=0)  # the same lr in a run of 5 steps
    whole = _train(cfg, tmp_path / "whole")
    cut = typed_config({**cfg, "train": {**cfg["train"], "steps": 5, "snapshot_dir": str(shm),
                                         "snapshot_every": 2}})
    run_local_world(2, _train_then_stop_keeping_snapshots, (cut, str(tmp_path / "run")),
                    timeout_s=300, comm_timeout_s=60)
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # killed: only the snapshots continue it
    held = {int(os.path.basename(p).split("_")[1]): len(os.listdir(p))
            for p in glob.glob(f"{shm}/**/checkpoints/step_*", recursive=True)}
    assert held == {1: 2, 3: 2}, held  # both ranks' parts of steps 1 and 3, nothing else
    rows = _train({**cfg, "train": {**cfg["train"], "snapshot_dir": str(shm),
                                    "snapshot_every": 2}}, tmp_path / "run")
    assert len(rows) == 6 and rows[4:] == whole[4:], (rows, whole)


# ---- Adam's step count through a save and a load (one process, no world) --------------------
class GroupStepAdam(torch.optim.Optimizer):
    """Adam that counts its steps as Transformer Engine's FusedAdam does (megatron-core's
    ``Adam`` where TE is installed; apex's FusedAdam alike): one Python int per param group,
    ``group["step"] += 1`` when present, else 1 (TE's
    ``transformer_engine/pytorch/optimizers/fused_adam.py``, ``step()``), and per parameter only
    ``exp_avg`` and ``exp_avg_sq``, no step. The update is plain Adam in Python, so the test
    runs where neither TE nor apex is installed."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            if not group["params"]:
                continue  # TE skips an empty group: its step stays where it is
            group["step"] = group["step"] + 1 if "step" in group else 1
            (b1, b2), t = group["betas"], group["step"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt().add_(group["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))


def _adam_stage(adam_class, params):
    """A StageOptimizer over ``params`` whose megatron optimizer is a stand-in holding
    ``adam_class`` (what ldt.training.optim reads of megatron's: ``.optimizer``, ``.config``)."""
    from types import SimpleNamespace

    from ldt.training.optim import StageOptimizer

    inner = SimpleNamespace(optimizer=adam_class([{"params": params[:1]},
                                                  {"params": params[1:]}], lr=1e-2),
                            config=SimpleNamespace(optimizer="adam"))
    return StageOptimizer(chunks=[], ddp=[], models=[], optimizer=inner, scheduler=None,
                          pg_collection=None)


def _adam_steps(stage, params, steps: range):
    for k in steps:
        for i, p in enumerate(params):
            p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (k + 1) + i) \
                .view(p.shape)
        stage.optimizer.optimizer.step()


@pytest.mark.parametrize("adam_class", [GroupStepAdam, torch.optim.AdamW])
@pytest.mark.parametrize("path", ["checkpoint", "snapshot"])
def test_adams_step_count_survives_a_save_and_a_load(adam_class, path):
    """A checkpoint (param_state -> load_param_state) and a snapshot (local_param_state ->
    set_local_param_state) carry Adam's step whether the optimizer counts it per parameter
    (torch's AdamW) or per param group (TE's and apex's FusedAdam): saved as 3 after 3 steps,
    and the resumed optimizer's next step is the uninterrupted one's, bit for bit (a step
    lost restarts bias correction at t=1 on top of the restored moments)."""
    from ldt.training.optim import (load_param_state, local_param_state, param_state,
                                    set_local_param_state)

    save, load = ((lambda s, p: param_state(s, p, None), load_param_state)
                  if path == "checkpoint" else (local_param_state, set_local_param_state))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)),
              torch.nn.Parameter(torch.randn(4, generator=gen))]
    whole = _adam_stage(adam_class, params)
    _adam_steps(whole, params, range(3))
    saved = [save(whole, p) for p in params]
    assert [float(s["step"]) for s in saved] == [3.0, 3.0]
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = _adam_stage(adam_class, again)
    for p, tensors in zip(again, saved):
        load(resumed, p, tensors)
    _adam_steps(whole, params, range(3, 4))
    _adam_steps(resumed, again, range(3, 4))
    assert all(torch.equal(a, b) for a, b in zip(params, again))
