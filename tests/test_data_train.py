"""Text -> ldt-preprocess -> ldt-train data.blend=..., end to end, as a user runs it.

One tokenizer (trained here on local text) and two datasets (a text file, a JSONL file with
bad lines) made by the real ``ldt-preprocess``; then a weighted blend of both trains on the
U-shape (cpu_demo) and on a VTP pipeline (cpu_vtp), each matching the single-process reference
of ``train.verify`` within 1e-5; a resume continues exactly (same layout) and into the other
layout; and the U-shape's audit shows that nothing but activations and gradients crossed to
the cloud, which opened no file of the user's.
"""

import csv
import json
import subprocess
import sys

import pytest
from data_corpus import sources, train_tokenizer, write_jsonl, write_text
from train_cli import run_train

PARITY = 1e-5
STEPS = 4
# what may reach a cloud rank besides boundary activations and gradients: (op, caller) ->
# why it carries nothing derived from the data
ALLOWED_TO_CLOUD = {
    ("barrier", "megatron.core.datasets.blended_megatron_dataset_builder"): "no payload",
    ("gather", "ldt.training.checkpoint"): "the stage's own weights (TP shards)",
    ("all_reduce", "ldt.training.checkpoint"): "a save-failed flag (float64 scalar)",
    ("broadcast", "ldt.training.checkpoint"): "the save's outcome flag (float64 scalar)",
    ("all_reduce", "ldt.training.guard"): "stop signal, non-finite flags, per-stage peak "
                                          "memory (float64 scalars)",
    ("all_reduce", "megatron.core.optimizer.clip_grads"): "the squared gradient norm (float32 "
                                                          "scalar, ldt's cross-stage group)",
    ("all_reduce", "megatron.core.distributed.param_and_grad_buffer"): "the stage's gradients "
                                                                       "over its own DP group",
    ("all_gather_object", "megatron.core.optimizer"): "param-group keys (weight decay, lr "
                                                      "multipliers), once at the start",
    ("all_gather_object", "ldt.training.outputs"): "per-action timings of the schedule",
}


def run(*args, timeout=300):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    text, jsonl = write_text(str(root / "a.txt")), write_jsonl(str(root / "b.jsonl"))
    tok = train_tokenizer(str(root / "tok"), sources(0, 8))
    made = {}
    for name, path, workers in (("a", text, "2"), ("b", jsonl, "1")):
        made[name] = run("-m", "ldt.tools.preprocess", "--input", path, "--output-prefix",
                         str(root / name), "--tokenizer", tok, "--workers", workers, "--quiet")
    assert made["a"]["bad_lines"] == 0 and made["b"]["bad_lines"] == 4
    return {"root": root, "tok": tok,
            "overrides": [f"data.blend=[0.3,{root}/a,0.7,{root}/b]", f"data.tokenizer={tok}",
                          f"data.cache_dir={root}/cache", "model.vocab_size=320",
                          f"train.steps={STEPS}", "train.verify=true"]}


def train(run_dir, blend, *overrides):
    summary = run_train(f"run_dir={run_dir}", *blend["overrides"], *overrides).summary()
    with open(run_dir / "metrics.csv") as f:
        summary["losses"] = [float(r["loss"]) for r in csv.DictReader(f)]
    return summary


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def ushape(blend, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ushape")
    summary = train(run_dir, blend, "cluster=cpu_demo", "train.eval_every=2",
                    "train.save_every=2", "train.audit_comm=true")
    return run_dir, summary


@pytest.mark.timeout(400)
def test_ushape_trains_on_the_blend_and_matches_the_reference(ushape):
    _, summary = ushape
    assert summary["parity_max_abs_diff"] < PARITY, summary  # losses and eval losses
    assert len(summary["losses"]) == STEPS and summary["eval_loss"] > 0
    assert summary["final_loss"] < summary["first_loss"]


@pytest.mark.timeout(400)
def test_nothing_but_activations_reaches_the_cloud(ushape, blend):
    run_dir, _ = ushape
    boundary = records(run_dir / "comm_audit.jsonl")
    assert boundary and all(r["dtype"] == "float32" and r["shape"] == [64, 2, 64]
                            for r in boundary)  # seq, micro-batch, hidden: activations only
    messages = records(run_dir / "comm_audit_messages.jsonl")
    # a cloud rank that opened a file of the user's or loaded a tokenizer shows up here
    assert [r for r in messages if r["kind"] != "message"] == []
    # the tap saw megatron-core's dataset barriers on every rank, cloud ranks included
    built = [r for r in messages if r["site"].startswith("megatron.core.datasets")]
    assert {r["rank"] for r in built} == {0, 1, 2, 3}
    for r in messages:
        key = (r["op"], r["site"].split(":")[0])
        assert key in ALLOWED_TO_CLOUD, r
        assert all(t["dtype"].startswith("float") for t in r["tensors"]), r  # no ids, labels
        # tuples: the timings, one per rank; megatron's param-group keys, one per group
        assert r.get("objects") is None or set(r["objects"]) == {"tuple"}, r


@pytest.mark.timeout(400)
def test_vtp_resumes_the_ushape_run_exactly(ushape, blend, tmp_path):
    """cpu_vtp (TP 2/1/2, plain pipeline: both edge stages read data) from the U-shape's
    checkpoint after step 2: the reference's losses, and the U-shape's own."""
    run_dir, first = ushape
    step_dir = run_dir / "checkpoints" / "step_0000001"
    other = train(tmp_path / "vtp", blend, "cluster=cpu_vtp", f"train.resume={step_dir}")
    assert other["first_step"] == 2 and other["parity_max_abs_diff"] < PARITY, other
    assert other["losses"] == pytest.approx(first["losses"][2:], abs=PARITY)
    same = train(tmp_path / "same", blend, "cluster=cpu_demo", f"train.resume={step_dir}",
                 "train.verify=false")
    assert same["losses"] == pytest.approx(first["losses"][2:], abs=1e-6)
