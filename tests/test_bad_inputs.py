"""Bad and misdirected inputs to every tool, as data: one line, exit 2, nothing damaged.

Each row of :data:`ROWS` is (tool, arguments, exit status, a pattern the one-line message must
match: the field or flag and the fix). Every row runs in-process in one scratch folder
(:func:`world`: tiny Hugging Face models, ldt checkpoints good and damaged, YAML files broken
on purpose, a run folder, a measured timeline) and asserts the exit status, exactly one line
on stderr matching the pattern, no traceback anywhere, and that every file and folder of the
scratch folder (hidden ones too) is byte-identical before and after. No row starts a process:
the launcher and the audit's world are replaced by a guard that fails the row if reached, so
a row that should be refused and is not fails here instead of training.

The rows cover the report of issue #34 (a failed re-import over a good checkpoint, an import
into a user's folder, export of a corrupted checkpoint or into an existing folder,
preprocessing over its own input, a run pointed at an old run, runaway counts, meaningless
audit settings, NaN weights, an out-of-range --seq-length, malformed YAML / JSON, unknown
keys, truncated files, unwritable outputs) and more of the same kinds, and those of #39 (a
run folder held by a live run, resume=auto over a run it cannot continue, measured times that
are not times, fused tensors of the wrong shape, folders and devices given as files, a
sequence length that does not fit). The few commands that should succeed, with what they
declare, are the tests at the end.
"""

import json
import os
import shutil

import pytest
import torch

from faults import tree as _tree
from tiny_files import _action_times, _hf_llama  # noqa: F401  (the other tests' too)

SEQ_ERR = r"argument --seq-length: .* must be >= 1"
EXISTS = r"already exists .* add --overwrite"


# ---- the scratch folder -------------------------------------------------------------------
def _edit_safetensors(folder, change):
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _flip(path, offset=64, n=100):
    data = bytearray(open(path, "rb").read())
    for i in range(offset, offset + n):
        data[i % len(data)] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _reseal(folder):
    from ldt.models.tensor_files import mark_complete

    for name in ("COMPLETE", "checkpoint.json"):  # (a part written into it unsealed it)
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    mark_complete(folder, -1)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_files):
    """Everything the rows point at (built once; no row may change it)."""
    from ldt.models.tensor_files import read_tensors, tensor_index, write_tensors

    w = tmp_path_factory.mktemp("world")
    shutil.copytree(tiny_model_files / "hf", w / "hf_a")
    for name in ("hf_b", "hf_nan", "hf_trunc", "hf_badjson", "hf_type", "hf_arch", "hf_nosafe",
                 "hf_index_missing", "hf_index_bad"):
        shutil.copytree(w / "hf_a", w / name)
    _edit_safetensors(w / "hf_b", lambda t: t.update(
        {"model.layers.1.mlp.up_proj.weight": torch.zeros(48, 32)}))
    _edit_safetensors(w / "hf_nan", lambda t: t["model.layers.0.mlp.up_proj.weight"]
                      .__setitem__((0, 0), float("nan")))
    for name, change in (  # #39: each source tensor of a fused one, checked before fusing
            ("hf_q", {"model.layers.0.self_attn.q_proj.weight": (30, 32)}),
            ("hf_k", {"model.layers.1.self_attn.k_proj.weight": (8, 32)}),
            ("hf_v", {"model.layers.0.self_attn.v_proj.weight": (16, 31)}),
            ("hf_gateup", {"model.layers.0.mlp.gate_proj.weight": (72, 32),  # sums right
                           "model.layers.0.mlp.up_proj.weight": (56, 32)}),
            ("hf_emb", {"model.embed_tokens.weight": (255, 32)})):
        shutil.copytree(w / "hf_a", w / name)
        _edit_safetensors(w / name, lambda t, c=change: t.update(
            {k: torch.zeros(*shape) for k, shape in c.items()}))
    os.truncate(w / "hf_trunc" / "model.safetensors", 3000)
    (w / "hf_badjson" / "config.json").write_text('{"model_type": "llama",,}\n')
    cfg = json.loads((w / "hf_a" / "config.json").read_text())
    (w / "hf_type" / "config.json").write_text(json.dumps({**cfg, "model_type": "nosuch"}))
    shutil.copytree(w / "hf_a", w / "hf_fieldtype")  # #39, found by test_tools_property
    (w / "hf_fieldtype" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": True}))
    shutil.copytree(w / "hf_a", w / "hf_kv0")  # #39, found by test_tools_property too
    (w / "hf_kv0" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 0}))
    (w / "hf_arch" / "config.json").write_text(json.dumps(
        {**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    os.remove(w / "hf_nosafe" / "model.safetensors")
    for name, text in (("hf_index_missing", json.dumps({"weight_map": {
            "model.embed_tokens.weight": "model-00009-of-00009.safetensors"}})),
            ("hf_index_bad", '{"weight_map": {"a": "b"\n')):
        (w / name / "model.safetensors.index.json").write_text(text)

    (w / "ckpt").mkdir()
    shutil.copytree(tiny_model_files / "ckpt", w / "ckpt" / "good")
    good = w / "ckpt" / "good"
    (w / "userdir" / "stage_0").mkdir(parents=True)
    (w / "userdir" / "stage_0" / "keep.txt").write_text("a user's file")
    for name in ("ckpt_flip", "ckpt_trunc", "ckpt_incomplete", "ckpt_badinfo", "ckpt_nan",
                 "ckpt_nomodel"):
        shutil.copytree(good, w / name)
    _flip(w / "ckpt_flip" / "stage_1" / "__0_0.distcp")
    os.truncate(w / "ckpt_trunc" / "stage_1" / "__0_0.distcp", 100)
    os.remove(w / "ckpt_incomplete" / "COMPLETE")
    (w / "ckpt_badinfo" / "checkpoint.json").write_text('{"step": ')
    index = tensor_index(str(good))
    names = [n for n, (folder, _) in index.items() if folder.endswith("stage_1")]
    nan = read_tensors(index, names)
    nan[names[0]].view(-1)[0] = float("nan")
    shutil.rmtree(w / "ckpt_nan" / "stage_1")
    write_tensors(str(w / "ckpt_nan"), 1, nan, -1)
    _reseal(w / "ckpt_nan")
    os.remove(w / "ckpt_nomodel" / "model.json")
    _reseal(w / "ckpt_nomodel")
    (w / "hf_out_old").mkdir()
    shutil.copy(w / "hf_a" / "model.safetensors", w / "hf_out_old")

    (w / "corpus.txt").write_text("A paragraph.\n\nAnother one.\n" * 20)
    (w / "corpus.bin").write_bytes(b"\x01\x02" * 50)  # an earlier output, or the user's data
    (w / "corpus.idx").write_bytes(b"MMIDIDX\x00\x00")
    (w / "empty.txt").write_text("")
    (w / "data").mkdir()

    yaml_files = {
        "inv_syntax.yaml": "kinds:\n  - {name: a, device: cpu count: 2}\n",
        "inv_key.yaml": "kinds:\n  - {name: a, device: cpu, count: 2, tflops: 1, memory_gib: 8,"
                        " intra_bw_gbps: 10, colour: red}\n",
        "inv_type.yaml": "kinds:\n  - {name: a, device: cpu, count: two, tflops: 1, "
                         "memory_gib: 8, intra_bw_gbps: 10}\n",
        "inv_list.yaml": "- a\n- b\n",
        "inv_nokinds.yaml": "name: x\n",
        "inv_edge.yaml": "edge: gpu\nkinds:\n  - {name: a, device: cpu, count: 2, tflops: 1, "
                         "memory_gib: 8, intra_bw_gbps: 10}\n",
        "inv_count.yaml": "kinds:\n  - {name: a, device: cpu, count: -1, tflops: 1, "
                          "memory_gib: 8, intra_bw_gbps: 10}\n",
        "inv_device.yaml": "kinds:\n  - {name: a, device: tpu, count: 2, tflops: 1, "
                           "memory_gib: 8, intra_bw_gbps: 10}\n",
        "inv_tab.yaml": "kinds:\n\t- {name: a}\n",
        "model_syntax.yaml": "num_layers: [2\n",
        "model_key.yaml": "num_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\nheads: 4\n",
        "model_heads.yaml": "num_layers: 2\nhidden_size: 30\nnum_attention_heads: 4\n",
        "cluster_syntax.yaml": "stages:\n  - {name: a tp: 1}\n",
        "cluster_key.yaml": "stages:\n  - {name: a, tp: 1, colour: 2}\n  - {name: b}\n",
        "cluster_layout.yaml": "stages:\n  - {name: a}\n  - {name: b}\nlayout: 'Etq|tL'\n",
        "cluster_tp.yaml": "stages:\n  - {name: a, tp: 3}\n  - {name: b}\n",
        "not_utf8.yaml": None,
    }
    for name, text in yaml_files.items():
        if text is None:
            (w / name).write_bytes(b"kinds: \xff\xfe\n")
        else:
            (w / name).write_text(text)
    (w / "conf" / "cluster").mkdir(parents=True)
    (w / "conf" / "cluster" / "bad.yaml").write_text(
        "defaults: [base_cluster]\nstages:\n  - {name: a tp: 1}\n")
    (w / "conf" / "cluster" / "key.yaml").write_text(
        "defaults: [base_cluster]\nstages:\n  - {name: a, tp: 1, colour: 2}\n")
    (w / "plans" / "cluster").mkdir(parents=True)
    (w / "plans" / "cluster" / "mine.yaml").write_text("stages: [{name: a}]\n")
    (w / "t.png").write_bytes(b"\x89PNG a user's picture")

    run = w / "run_old"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("train: {steps: 5}\n")
    (run / "config.yaml").write_text("train: {steps: 5}\n")
    (run / "metrics.csv").write_text("step,loss\n0,5.5\n")
    for name in ("measured", "measured_trunc", "measured_header"):
        (w / name).mkdir()
    _action_times(w / "measured" / "action_times.csv")
    (w / "measured" / "config.yaml").write_text("cluster: {stages: [{name: a}, {name: b}]}\n")
    text = (w / "measured" / "action_times.csv").read_text()
    (w / "measured_trunc" / "action_times.csv").write_text(text[:len(text) // 2 + 7])
    (w / "measured_header" / "action_times.csv").write_text("a,b\n1,2\n")
    (w / "measured_lanes").mkdir()  # a per-stage DP run writes its lanes' timeline instead
    (w / "measured_lanes" / "lane_times.csv").write_text(
        "step,lane,stage,replica,action,start_s,end_s,host,step_start_s\n"
        "0,2,1,1,2F1,0.1,0.2,h,5.0\n")
    (w / "cloud_small.txt").write_text("tiny")
    (w / "audit_old").mkdir()
    (w / "audit_old" / "audit.json").write_text("{}")
    (w / "report.json").write_text("{}")
    # #39: a run whose only checkpoint never finished; a run folder a live run holds; a run
    # whose newest checkpoint is damaged; measured times edited to impossible values
    shutil.copytree(run, w / "run_incomplete")
    shutil.copytree(w / "ckpt_incomplete", w / "run_incomplete" / "checkpoints" / "step_0000001")
    shutil.copytree(good, w / "run_flip" / "checkpoints" / "step_0000001")
    shutil.copytree(w / "ckpt_flip", w / "run_flip" / "checkpoints" / "step_0000002")
    (w / "run_live").mkdir()
    (w / "run_live" / "metrics.csv").write_text("step,loss\n0,5.5\n")
    holder = _hold_lock(w / "run_live")
    rows = text.splitlines()
    for name, column, value in (("measured_nan", 4, "nan"), ("measured_back", 4, "-1.0"),
                                ("measured_inf", 6, "inf")):
        (w / name).mkdir()
        edited = rows[:]
        fields = edited[9].split(",")
        fields[column] = value
        edited[9] = ",".join(fields)
        (w / name / "action_times.csv").write_text("\n".join(edited) + "\n")
    (w / "measured_twice").mkdir()  # two runs' rows in one file
    (w / "measured_twice" / "action_times.csv").write_text("\n".join(rows + rows[1:]) + "\n")
    try:
        yield w
    finally:
        holder.kill()
        holder.wait()


def _hold_lock(run_dir):
    """A process that holds ``run_dir``'s lock as a training run does, until killed."""
    import subprocess
    import sys

    code = ("import sys, time\nfrom ldt.storage.runlock import RunLock\n"
            "RunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ---- the rows -----------------------------------------------------------------------------
C, P, PL, S, A, T = "ldt-convert", "ldt-preprocess", "ldt-plan", "ldt-sim", "ldt-audit", \
    "ldt-train"
PLAN = ["--inventory", "cpu_local", "--model", "gpt_tiny"]
SIM = ["--cluster", "cpu_demo", "--model", "gpt_tiny", "--inventory", "cpu_local"]
ROWS = [
    # -- ldt-convert import: what is at OUT survives, damaged weights never come in
    (C, "import hf_b ckpt/good", 2, EXISTS),
    (C, "import hf_b ckpt/good --overwrite", 2, r"tensor model.layers.1.mlp.up_proj.weight has "
                                                r"shape \(48, 32\), but its config.json .*"
                                                r"implies \(64, 32\)"),
    (C, "import hf_a userdir", 2, r"OUT userdir already exists"),
    (C, "import hf_nan out1", 2, r"tensor model.layers.0.mlp.up_proj.weight holds 1 NaN/Inf"),
    (C, "import hf_q out1", 2, r"tensor model.layers.0.self_attn.q_proj.weight has shape "
                               r"\(30, 32\), but its config.json .* implies \(32, 32\)"),
    (C, "import hf_k out1", 2, r"model.layers.1.self_attn.k_proj.weight has shape \(8, 32\)"),
    (C, "import hf_v out1", 2, r"model.layers.0.self_attn.v_proj.weight has shape \(16, 31\)"),
    (C, "import hf_gateup out1", 2, r"model.layers.0.mlp.gate_proj.weight has shape \(72, 32\)"),
    (C, "import hf_emb out1", 2, r"model.embed_tokens.weight has shape \(255, 32\).* vocab 256"),
    (C, "import /dev/null out1", 2, r"/dev/null is not a regular file or folder \(a device"),
    (C, "import hf_trunc out1", 2, r"model.safetensors is not a readable safetensors file .* "
                                   r"restore it"),
    (C, "import hf_badjson out1", 2, r"config.json hf_badjson/config.json:1:24: invalid JSON"),
    (C, "import hf_type out1", 2, r"not a config transformers can read .*give the config.json"),
    (C, "import hf_arch out1", 2, r"ldt converts LlamaForCausalLM, Qwen2ForCausalLM"),
    (C, "import hf_kv0 out1", 2, r"num_key_value_heads=0 with num_attention_heads=4; the KV "
                                 r"heads must be >= 1 and divide"),
    (C, "import hf_fieldtype out1", 2, r"config.json is not a config transformers can read "
                                       r"\(Validation error for field 'num_hidden_layers': "
                                       r"TypeError: .* expected int, got bool"),
    (C, "import hf_nosafe out1", 2, r"hf_nosafe has no \*.safetensors file"),
    (C, "import hf_index_missing out1", 2, r"is named by the folder's safetensors index but "
                                           r"does not exist"),
    (C, "import hf_index_bad out1", 2, r"safetensors index .*index.json:2:1: invalid JSON"),
    (C, "import nowhere out1", 2, r"nowhere: no such file or folder; give a Hugging Face model "
                                 r"folder"),
    (C, "import corpus.txt out1", 2, r"corpus.txt is a file, not a folder"),
    (C, "import hf_a hf_a", 2, r"OUT hf_a is also the input HF_FOLDER"),
    (C, "import hf_a hf_a/sub", 2, r"lies inside the input HF_FOLDER"),
    (C, "import hf_a . --overwrite", 2, r"holds the input HF_FOLDER"),
    (C, "import hf_a out1 --seq-length=-5", 2, SEQ_ERR),
    (C, "import hf_a out1 --seq-length 0", 2, SEQ_ERR),
    (C, "import hf_a out1 --seq-length 4096", 2, r"--seq-length 4096 exceeds the model's "
                                                 r"max_position_embeddings 64; give at most 64"),
    (C, "import hf_a out1 --seq-length ten", 2, r"--seq-length: 'ten' is not a whole number"),
    (C, "import hf_a out1 --name ../x", 2, r"--name '../x': a config name is"),
    (C, "import hf_a out1 --dtype float64", 2, r"argument --dtype: invalid choice"),
    (C, "import hf_a /proc/ldt_out", 2, r"OUT /proc/ldt_out: cannot write there"),
    (C, "import hf_a", 2, r"required: out"),
    (C, "", 2, r"required: command"),
    (C, "convert hf_a out1", 2, r"invalid choice: 'convert'"),
    # -- ldt-convert export: a damaged checkpoint is never passed on
    (C, "export ckpt_flip out2", 2, r"ckpt_flip/stage_1/__0_0.distcp is corrupted"),
    (C, "export ckpt_trunc out2", 2, r"ckpt_trunc/stage_1/__0_0.distcp is truncated"),
    (C, "export ckpt_badinfo out2", 2, r"ckpt_badinfo/checkpoint.json is missing or damaged"),
    (C, "export ckpt_nan out2", 2, r"holds 1 NaN/Inf value.*use a checkpoint whose weights"),
    (C, "export ckpt_nomodel out2", 2, r"has no model.json.*written by ldt-train"),
    (C, "export ckpt_incomplete out2", 2, r"holds no complete ldt checkpoint.*give a run"),
    (C, "export ckpt/good hf_out_old", 2, EXISTS),
    (C, "export ckpt/good ckpt/good/hf", 2, r"lies inside the input CHECKPOINT"),
    (C, "export ckpt/good ckpt/good --overwrite", 2, r"is also the input CHECKPOINT"),
    (C, "export nowhere out2", 2, r"'nowhere' holds no complete ldt checkpoint"),
    (C, "export hf_a out2", 2, r"'hf_a' holds no complete ldt checkpoint"),
    (C, "export ckpt/good /proc/ldt_out", 2, r"cannot write there"),
    (C, "export run_flip out2", 2, r"step_0000002/stage_1/__0_0.distcp is corrupted.*give an "
                                   r"earlier one as CHECKPOINT \(.*step_0000001\)$"),
    (C, "export run_live out2", 2, r"CHECKPOINT run_live: the run in .*run_live is training "
                                   r"now \(pid \d+ on .* since .*\); .*wait until it ends"),
    (C, "export /dev/null out2", 2, r"CHECKPOINT /dev/null is not a regular file"),
    (C, "export corpus.txt out2", 2, r"CHECKPOINT corpus.txt is a file, not a folder"),
    # -- ldt-preprocess
    (P, "--input corpus.bin --output-prefix corpus --overwrite", 2,
     r"corpus.bin is also the input --input; an input is never overwritten"),
    (P, "--input corpus.txt --output-prefix corpus", 2, r"--output-prefix .*corpus.bin "
                                                        r"already exists .*--overwrite"),
    (P, "--input nowhere.txt --output-prefix x", 2, r"--input nowhere.txt: no such file or "
                                                   r"folder"),
    (P, "--input empty.txt --output-prefix x", 2, r"--input empty.txt is empty"),
    (P, "--input data --output-prefix x", 2, r"--input data is a folder, not a file"),
    (P, "--input corpus.txt --output-prefix data/", 2, r"names a folder.*give e.g. data/corpus"),
    (P, "--input corpus.txt --output-prefix data", 2, r"names a folder"),
    (P, "--input corpus.txt --output-prefix nodir/x", 2, r"folder .*nodir does not exist"),
    (P, "--input corpus.txt --output-prefix x.bin", 2, r"without .bin / .idx"),
    (P, "--input corpus.txt --output-prefix x --workers 0", 2, r"--workers: 0 must be in \[1,"),
    (P, "--input corpus.txt --output-prefix x --workers 100000", 2, r"4 per core"),
    (P, "--input corpus.txt --output-prefix x --workers two", 2, r"not a whole number"),
    (P, "--input corpus.txt --output-prefix x --format xml", 2, r"--format: invalid choice"),
    (P, "--input corpus.txt --output-prefix x --text-documents page", 2, r"invalid choice"),
    (P, "--input corpus.txt --output-prefix x --tokenizer gpt2", 2, r"never downloads"),
    (P, "--output-prefix x", 2, r"required: --input"),
    (P, "--input /dev/null --output-prefix x", 2, r"--input /dev/null is not a regular file"),
    # -- ldt-plan
    (PL, "--inventory inv_syntax.yaml --model gpt_tiny", 2,
     r"inventory inv_syntax.yaml:2:32: invalid YAML .*fix the syntax"),
    (PL, "--inventory inv_key.yaml --model gpt_tiny", 2,
     r"inventory.kinds\[0\].colour .* not a field of DeviceKind; remove it"),
    (PL, "--inventory inv_type.yaml --model gpt_tiny", 2, r"inventory.count .*'two'"),
    (PL, "--inventory inv_list.yaml --model gpt_tiny", 2, r"holds a list, not a mapping"),
    (PL, "--inventory inv_nokinds.yaml --model gpt_tiny", 2, r"inventory.kinds .*missing"),
    (PL, "--inventory inv_edge.yaml --model gpt_tiny", 2, r"inventory.edge='gpu' names no kind"),
    (PL, "--inventory inv_count.yaml --model gpt_tiny", 2, r"count=-1 must be > 0"),
    (PL, "--inventory inv_device.yaml --model gpt_tiny", 2, r"device='tpu'; use one of"),
    (PL, "--inventory inv_tab.yaml --model gpt_tiny", 2, r"inv_tab.yaml:2:1: invalid YAML"),
    (PL, "--inventory not_utf8.yaml --model gpt_tiny", 2, r"not UTF-8 text"),
    (PL, "--inventory nosuch --model gpt_tiny", 2, r"inventory 'nosuch' is neither a file nor"),
    (PL, "--inventory cpu_local --model model_syntax.yaml", 2, r"model_syntax.yaml:2:1: invalid"),
    (PL, "--inventory cpu_local --model model_key.yaml", 2, r"model.heads is not a field"),
    (PL, "--inventory cpu_local --model model_heads.yaml", 2, r"hidden_size=30 .*multiple"),
    (PL, PLAN + ["--mbs", "0"], 2, r"--mbs: 0 must be >= 1"),
    (PL, PLAN + ["--mbs", "-1"], 2, r"--mbs: -1 must be >= 1"),
    (PL, PLAN + ["--mbs", "one"], 2, r"--mbs: 'one' is not a whole number"),
    (PL, PLAN + ["--global-batch", "0"], 2, r"--global-batch: 0 must be >= 1"),
    (PL, PLAN + ["--global-batch", "1000000000"], 2, r"--global-batch=1000000000: .* use at "
                                                     r"most --global-batch="),
    (PL, PLAN + ["--global-batch", "10", "--mbs", "4"], 2, r"not a multiple of micro_batch"),
    (PL, PLAN + ["--max-stages", "0"], 2, r"--max-stages: 0 must be >= 1"),
    (PL, PLAN + ["--edge-min-layers", "-1"], 2, r"--edge-min-layers: -1 must be >= 0"),
    (PL, PLAN + ["--dtype", "fp8"], 2, r"--dtype: invalid choice"),
    (PL, "--inventory edge_cloud --model gpt_tiny --edge-min-layers 100", 2,
     r"--edge-min-layers 100: the edge would keep 200 of gpt_tiny's 6 layers.*at most 2"),
    (PL, "--inventory edge_cloud --model gpt_tiny --max-stages 1", 2,
     r"--max-stages 1 with a U-shape.*--no-u-shape"),
    (PL, PLAN + ["--out", "plans/cluster/mine.yaml"], 2, r"--out plans/cluster/mine.yaml "
                                                         r"already exists"),
    (PL, PLAN + ["--out", "a.yaml", "--png", "a.yaml"], 2, r"name the same file twice"),
    (PL, ["--inventory", "inv_key.yaml", "--model", "gpt_tiny", "--out", "inv_key.yaml",
          "--overwrite"], 2, r"--out inv_key.yaml is also the input --inventory"),
    (PL, PLAN + ["--out", "/proc/ldt/c.yaml"], 2, r"--out .*: cannot"),
    (PL, PLAN + ["--png", "t.png"], 2, r"--png t.png already exists"),
    (PL, PLAN + ["--trace", "corpus.txt"], 2, r"--trace corpus.txt already exists"),
    (PL, PLAN + ["--out", "data", "--overwrite"], 2, r"--out data is a folder; give the path"),
    (PL, PLAN + ["--png", "/dev/null", "--overwrite"], 2, r"--png /dev/null is not a regular"),
    (S, SIM + ["-m", "4", "--trace", "data/"], 2, r"--trace data/ is a folder"),
    (A, "--json data", 2, r"--json data is a folder"),
    (PL, "--model gpt_tiny", 2, r"required: --inventory"),
    (PL, "--inventory /dev/null --model gpt_tiny", 2, r"inventory /dev/null is not a regular"),
    (PL, "--inventory /dev/zero --model gpt_tiny", 2, r"inventory /dev/zero is not a regular"),
    # -- ldt-sim
    (S, SIM + ["-m", "0"], 2, r"-m/--num-microbatches: 0 must be >= 1"),
    (S, SIM + ["-m", "100000000"], 2, r"-m=100000000: the schedule's .* use at most -m="),
    (S, SIM + ["-m", "eight"], 2, r"not a whole number"),
    (S, SIM[:4], 2, r"--inventory, --num-microbatches required"),
    (S, SIM + ["-m", "4", "--prefetch", "-1"], 2, r"--prefetch: -1 must be >= 0"),
    (S, ["--cluster", "cpu_uniform", *SIM[2:], "-m", "4", "--prefetch", "1"], 2,
     r"--prefetch 1: .*plain pipeline: drop --prefetch"),
    (S, SIM + ["-m", "4", "--mbs", "0"], 2, r"--mbs: 0 must be >= 1"),
    (S, SIM + ["-m", "4", "--prefetch", "1000000000"], 2, r"--prefetch 1000000000 exceeds -m 4"),
    (S, SIM + ["-m", "4", "--kinds", "cpu"], 2, r"--kinds lists 1 kinds for 3 stages"),
    (S, SIM + ["-m", "4", "--png", "t.png"], 2, r"--png t.png already exists"),
    (S, ["--cluster", "cluster_syntax.yaml", *SIM[2:], "-m", "4"], 2,
     r"cluster_syntax.yaml:2:16: invalid YAML"),
    (S, ["--cluster", "cluster_key.yaml", *SIM[2:], "-m", "4"], 2, r"colour"),
    (S, ["--cluster", "cluster_layout.yaml", *SIM[2:], "-m", "4"], 2,
     r"cluster.layout = 'Etq\|tL': unexpected character 'q'"),
    (S, ["--cluster", "cluster_tp.yaml", *SIM[2:], "-m", "4"], 2, r"tp=3 .* does not divide"),
    (S, "--measured measured_trunc", 2, r"action_times.csv:\d+: a damaged row"),
    (S, "--measured measured_header", 2, r"no action, end_s, start_s, step column"),
    (S, "--measured measured_lanes", 2, r"lane_times.csv times the lanes \(stage replicas\) "
                                       r"of a per-stage DP run.*one replica per stage"),
    (S, "--measured nowhere", 2, r"--measured nowhere: nowhere does not exist"),
    (S, "--measured hf_a", 2, r"hf_a/action_times.csv does not exist"),
    (S, "--measured measured --png measured/t.png", 2, r"lies inside the input --measured"),
    (S, "--measured measured --skip -1", 2, r"--skip: -1 must be >= 0"),
    (S, "--measured measured --skip 100", 2, r"--measured measured: .*"),
    (S, "--measured measured_nan", 2, r"action_times.csv:10: a damaged row \(end_s nan is not "
                                      r"a finite number\)"),
    (S, "--measured measured_back", 2, r"action_times.csv:10: .*end_s -1.0 is before start_s"),
    (S, "--measured measured_inf", 2, r"action_times.csv:10: .*step_start_s inf is not a "
                                      r"finite"),
    (S, "--measured /dev/null", 2, r"/dev/null is not a regular file"),
    (S, "--measured measured_twice", 2, r"the rows of step 3 are not a schedule a run executes "
                                        r"\(stage 0 runs 0F0 twice .*more than one run"),
    # -- ldt-audit (refused before any run starts)
    (A, "--clusters 0", 2, r"--clusters: 0 must be >= 2"),
    (A, "--clusters 1", 2, r"--clusters: 1 must be >= 2"),
    (A, "--clusters 100000000", 2, r"--clusters=100000000 exceeds the \d+ token vectors"),
    (A, "--shadow-tokens=-5", 2, r"--shadow-tokens: -5 must be >= 1"),
    (A, "--shadow-tokens 0", 2, r"--shadow-tokens: 0 must be >= 1"),
    (A, "--shadow-tokens 100000000000", 2, r"--shadow-tokens=100000000000: .* use at most"),
    (A, "--steps 0", 2, r"--steps: 0 must be >= 1"),
    (A, "--steps 100000000", 2, r"--steps=100000000: .* use at most --steps="),
    (A, "--noise nan", 2, r"--noise nan: give finite settings > 0"),
    (A, "--noise inf", 2, r"--noise inf: give finite settings > 0"),
    (A, "--noise -1", 2, r"--noise -1: give finite settings > 0"),
    (A, "--noise loud", 2, r"--noise 'loud': give numbers > 0"),
    (A, "--cloud-text nowhere.txt", 2, r"--cloud-text nowhere.txt: no such file or folder"),
    (A, "--cloud-text data", 2, r"--cloud-text data is a folder, not a file"),
    (A, "--cloud-text cloud_small.txt", 2, r"cloud_small.txt has 4 bytes; the shadow runs need"),
    (A, "--cloud-text /dev/null", 2, r"--cloud-text /dev/null is not a regular file"),
    (A, "--checkpoint nowhere", 2, r"--checkpoint='nowhere' does not exist"),
    (A, "--checkpoint ckpt_flip", 2, r"__0_0.distcp is corrupted"),
    (A, "--checkpoint ckpt_incomplete", 2, r"holds no complete checkpoint"),
    (A, "--checkpoint ckpt/good", 2, r"was written for model.num_layers=2 but this run has"),
    (A, "--out /dev/null", 2, r"--out /dev/null is not a regular file or folder"),
    (A, "--out audit_old", 2, r"--out audit_old already exists .*--overwrite"),
    (A, "--out corpus.txt", 2, r"--out corpus.txt already exists \(a file\)"),
    (A, "--json report.json", 2, r"--json report.json already exists"),
    (A, "--out /proc/ldt_audit", 2, r"cannot"),
    (A, "cluster=cpu_uniform", 2, r"cluster.u_shape=false: use a U-shape cluster"),
    (A, "cluster=nosuch", 2, r"Could not find 'cluster/nosuch'"),
    (A, "data.blend=corpus", 2, r"data.blend"),
    (A, "train.num_microbatches=0", 2, r"train.num_microbatches=0 must be >= 1"),
    # -- ldt-train (validation only: a row that got past it would hit the launch guard)
    (T, "train.num_microbatches=1000000000", 2, r"train.num_microbatches=1000000000: .* use at "
                                                r"most train.num_microbatches="),
    (T, "train.num_microbatches=100000 train.steps=100000", 2, r"train.steps=100000 with "
                                                               r"train.num_microbatches=100000"),
    (T, "train.micro_batch_size=1000000000", 2, r"train.num_microbatches x "
                                                r"train.micro_batch_size=4000000000"),
    (T, "cluster=cpu_uniform train.num_microbatches=1000000000", 2, r"use at most"),
    (T, "model.vocab_size=100000000000", 2, r"model.vocab_size=100000000000 x "
     r"model.hidden_size=64 .* GiB in this world's cpu processes.* lower model.vocab_size"),
    (T, "train.comm_timeout_s=1e300", 2, r"train.comm_timeout_s=1e\+300 must be .* at most"),
    (T, "hydra.run.dir=run_old", 2, r"hydra.run.dir=.*run_old already holds files .*"
                                    r"train.resume="),
    (T, "hydra.run.dir=run_old train.steps=0", 2, r"train.steps=0 must be >= 1"),
    (T, "run_dir=userdir", 2, r"userdir already holds files"),
    (T, "-m run_dir=run_old train.steps=1,2", 2, r"run_dir=run_old already holds files; a sweep"),
    (T, "-m hydra.sweep.dir=userdir train.steps=1,2", 2, r"hydra.sweep.dir=userdir already"),
    (T, "run_dir=corpus.txt", 2, r"hydra.run.dir=corpus.txt exists and is not a folder"),
    (T, "cluster=cpu_uniform cluster.layout=null model.num_layers=2 train.load=ckpt_trunc", 2,
     r"ckpt_trunc/stage_1/__0_0.distcp is truncated \(100 of"),
    (T, "train.resume=nowhere", 2, r"train.resume='.*nowhere' does not exist"),
    (T, "train.resume=ckpt_incomplete", 2, r"holds no complete checkpoint"),
    (T, "--config-dir conf cluster=bad", 2, r"conf/cluster/bad.yaml:3:16: invalid YAML"),
    (T, "--config-dir conf cluster=key", 2, r"Key 'colour' not in 'StageConfig'; remove the key"),
    (T, "cluster.layout=Etq|tt|tt|tL", 2, r"cluster.layout = 'Etq\|tt\|tt\|tL': unexpected "
                                         r"character 'q' at position 2; fix: use the tokens"),
    (T, "data.path=nowhere.txt", 2, r"data.path='.*nowhere.txt': no such file or folder"),
    (T, "data.path=empty.txt", 2, r"data.path=.*empty.txt"),
    (T, "train.lr=nan", 2, r"train.lr=nan must be a finite number"),
    (T, "hydra.output_subdir=/proc/ldt", 2, r"hydra.output_subdir=/proc/ldt: cannot make"),
    (T, "train.prefetch=100000", 2, r"train.prefetch=100000 exceeds train.num_microbatches=4"),
    (T, "cluster.link_delay_ms=nan", 2, r"link_delay_ms entry 0 \(nan\) must be a finite"),
    (T, "cluster.boundary_fanout=sometimes", 2,
     r"cluster.boundary_fanout='sometimes'; use one of auto, never, always"),
    # -- #39: a run folder has one owner; resume=auto never starts afresh over a run
    (T, "run_dir=run_old train.resume=auto", 2, r"train.resume=auto: .*run_old holds a run "
     r"\(.hydra, config.yaml, metrics.csv\) that cannot be continued: it saved no checkpoint"
     r".*give a new run_dir"),
    (T, "run_dir=run_incomplete train.resume=auto", 2, r"its checkpoints are all incomplete "
                                                       r"\(step_0000001: no COMPLETE marker"),
    (T, "run_dir=run_live train.resume=auto", 2, r"run_dir=.*run_live is in use by another run "
                                                 r"\(pid \d+ on .* since .*\); a run folder has "
                                                 r"one owner"),
    (T, "hydra.run.dir=run_live", 2, r"hydra.run.dir=.*run_live is in use by another run"),
    (T, "run_dir=run_new train.resume=run_live", 2, r"train.resume=.*run_live: the run in .* is "
                                                    r"training now \(pid \d+"),
    # -- #39: messages that name the thing
    (T, "model.seq_length=2147483648", 2, r"in the model.seq_length=2147483648 x "
     r"model.hidden_size=64 learned position embeddings.*lower model.seq_length"),
    (T, ["data.blend=no such/corpus"], 2, r"data.blend: .*/no such/corpus.bin and .*/no "
                                          r"such/corpus.idx do not exist"),
    (T, "data.path=/dev/null", 2, r"data.path='/dev/null' is not a regular file"),
    (T, "train.schedule=zb train.cost_inventory=nope", 2,  # the zero-bubble order's prices
     r"train.cost_inventory='nope': inventory 'nope' is neither a file nor a shipped config"),
    (T, "train.resume=/dev/null", 2, r"train.resume='/dev/null' is not a regular file"),
    (T, "data.tokenizer=/dev/null data.blend=corpus", 2, r"data.tokenizer='/dev/null' is not a "
                                                         r"regular file"),
    (T, "data.blend=corpus data.cache_dir=/dev/null", 2, r"data.cache_dir='/dev/null' is not a "
                                                         r"regular file or folder"),
    (T, "data.blend=corpus data.cache_dir=corpus.txt/idx", 2, r"data.cache_dir=.*corpus.txt/idx"
                                                              r"' cannot be made: .*corpus.txt is "
                                                              r"not a folder"),
]


def _argv(args):
    return args.split() if isinstance(args, str) else list(args)


def _main(tool):
    from ldt.job import train
    from ldt.tools import audit, convert, plan, preprocess, sim

    return {C: convert.main, P: preprocess.main, PL: plan.main, S: sim.main, A: audit.main,
            T: train.main}[tool]


def _run(tool, argv, capsys):
    try:
        code = _main(tool)(argv)
    except SystemExit as exc:  # argparse's exit after its one line
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def guarded(world, monkeypatch):
    """Run in the scratch folder, with every way to start a world replaced by a failure."""
    import ldt.job.train
    import ldt.launch.local

    def no_world(*args, **kwargs):
        raise AssertionError("a world was started: this input should have been refused")

    # ldt-train's own binding too: imported before, it would start a world unseen; imported
    # under the patch, it would keep the failure for every later test of the session
    for module in (ldt.launch.local, ldt.job.train):
        monkeypatch.setattr(module, "run_local_world", no_world)
    monkeypatch.chdir(world)
    return world


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tool, args, code, pattern", ROWS,
                         ids=[f"{r[0]} {' '.join(_argv(r[1]))}"[:80] for r in ROWS])
def test_bad_input_is_refused_in_one_line_and_damages_nothing(guarded, capsys, tool, args, code,
                                                              pattern):
    import re

    before = _tree(guarded)
    got, out, err = _run(tool, _argv(args), capsys)
    assert "Traceback" not in err + out, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert got == code, (got, err)
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]
    assert _tree(guarded) == before  # every byte the user had, and nothing left behind


def test_the_table_is_at_least_as_wide_as_the_report():
    """Issue #34 tried 133 inputs over six tools; the table has more, over every tool."""
    assert len(ROWS) >= 133
    assert {r[0] for r in ROWS} == {C, P, PL, S, A, T}


# ---- what should succeed, with the outputs it declares --------------------------------------
def test_export_of_a_run_says_which_incomplete_checkpoint_it_passed_over(guarded, capsys):
    """A run folder whose newest step folder never got its COMPLETE marker: the export uses
    the newest complete one and says so in one line; it writes only its OUT."""
    run = guarded / "run_export"
    shutil.copytree(guarded / "ckpt" / "good", run / "checkpoints" / "step_0000001")
    shutil.copytree(guarded / "ckpt_incomplete", run / "checkpoints" / "step_0000002")
    try:
        before = _tree(guarded)
        code, out, err = _run(C, ["export", str(run), "exp_out"], capsys)
        assert code == 0, err
        note = [ln for ln in out.splitlines() if "incomplete" in ln]
        assert len(note) == 1 and "step_0000002 is incomplete" in note[0] \
            and "step_0000001, is used" in note[0], out
        after = _tree(guarded)
        assert {k: v for k, v in after.items() if not k.startswith("exp_out")} == before
        assert sorted(os.listdir(guarded / "exp_out")) == [
            "config.json", "generation_config.json",
            *[f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)],
            "model.safetensors.index.json"]
    finally:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(guarded / "exp_out", ignore_errors=True)


def test_overwrite_replaces_a_checkpoint_whole(guarded, capsys, tmp_path):
    """--overwrite replaces OUT whole: a user's file in it does not survive into the import,
    and the import is a complete, loadable checkpoint."""
    import shlex

    from ldt.storage import checkpoint_files as files

    out = tmp_path / "my models" / "userdir"  # and the next command pastes (#39: spaces)
    shutil.copytree(guarded / "userdir", out)
    code, stdout, err = _run(C, ["import", "hf_a", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert not (out / "stage_0" / "keep.txt").exists()
    files.verify(str(out), which=[p for p in files.parts(str(out)) if p.startswith("stage_")])
    assert (out / "conf" / "model" / "userdir.yaml").exists()
    command = shlex.split(stdout.splitlines()[-1])
    assert command[:4] == ["ldt-train", f"hydra.searchpath=[file://{out}/conf]", "model=userdir",
                           f"train.load={out}"], command


def test_a_run_writes_hydra_files_only_once_its_folder_is_its_own(guarded, capsys,
                                                                  monkeypatch):
    """ldt-train writes .hydra/ (as Hydra would: the task config, Hydra's config, the
    overrides) and config.yaml into a new run folder once the config is accepted; the world
    itself is not started here."""
    import yaml

    import ldt.job.train
    from ldt.storage.runlock import LOCK_NAME, holder

    started = []
    monkeypatch.setattr(ldt.job.train, "_launch_local",  # the launcher holds the lock meanwhile
                        lambda cfg, topo, priced: started.append(holder(cfg.run_dir)) or 0)
    run = guarded / "run_new"
    try:
        code, _, err = _run(T, [f"hydra.run.dir={run}", "train.steps=3"], capsys)
        assert code == 0 and len(started) == 1, err
        assert started[0].startswith(f"pid {os.getpid()} ") and not (run / LOCK_NAME).exists()
        assert sorted(os.listdir(run / ".hydra")) == ["config.yaml", "hydra.yaml",
                                                      "overrides.yaml"]
        hydra = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]
        assert hydra["output_subdir"] == ".hydra"
        assert "hydra.output_subdir=null" not in hydra["overrides"]["hydra"]
        assert yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) == [
            "train.steps=3"]  # Hydra keeps hydra.* overrides in hydra.yaml
        assert f"hydra.run.dir={run}" in hydra["overrides"]["hydra"]
        assert yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["train"][
            "steps"] == 3
        # the same folder again: refused, nothing rewritten; resuming the run there: accepted
        before = _tree(run)
        code, _, err = _run(T, [f"hydra.run.dir={run}", "train.steps=4"], capsys)
        assert code == 2 and "already holds files" in err and _tree(run) == before
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_resume_auto_continues_the_newest_complete_checkpoint_and_says_what_it_passed_over(
        tmp_path):
    """train.resume=auto: an absent or empty folder starts afresh; a run folder continues
    from its newest complete checkpoint, and the step folder newer than it whose save did not
    finish is named in one line (the launcher prints it as a warning)."""
    from ldt.storage.checkpoint_files import resume_auto, skipped

    for folder in (tmp_path / "absent", tmp_path / "empty"):
        train = {"resume": "auto", "load": None, "steps": 9}
        assert resume_auto(train, str(folder)) is None and train["resume"] is None
        (tmp_path / "empty").mkdir(exist_ok=True)
    run = tmp_path / "run"
    for step in (3, 5):
        folder = run / "checkpoints" / f"step_{step:07d}"
        folder.mkdir(parents=True)
        (folder / "checkpoint.json").write_text(json.dumps({"step": step}))
    (run / "checkpoints" / "step_0000003" / "COMPLETE").write_text("3\n")
    train = {"resume": "auto", "load": "elsewhere", "steps": 9}
    assert resume_auto(train, str(run)) is None
    assert train == {"resume": str(run / "checkpoints" / "step_0000003"), "load": None,
                     "steps": 9}
    note = skipped(train["resume"])
    assert note.startswith(f"{run}/checkpoints/step_0000005 is incomplete") \
        and note.endswith("step_0000003, is used"), note
