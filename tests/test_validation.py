"""Every bad config is refused by `ldt-train` with the field, the value and the fix.

Each case runs ldt-train's main (in this process, tests/train_cli.py; as a subprocess where it
plays a torchrun rank) and checks the exit status, the message and that the answer came before
any world started; a test of its own checks that a refusal imports neither torch nor
megatron-core. Expected texts are written here by hand; ``{tmp}`` in an override is a
per-test folder holding the files below.
"""

import os
import subprocess
import sys

import pytest
from train_cli import run_train

CASES = {
    "world_size": ([], {"WORLD_SIZE": "3", "RANK": "0"},
                   ["world size is 3", "dp * sum(tp) = 1 * 4 = 4", "launch 4 processes"]),
    "tp_heads": (["cluster.stages.1.tp=3"], {},
                 ["cluster.stages[1].tp=3", "model.num_attention_heads=4"]),
    "tp_ffn": (["model.ffn_hidden_size=255"], {},
               ["cluster.stages[1].tp=2", "model.ffn_hidden_size=255"]),
    "layer_count": (["model.num_layers=7"], {},
                    ["cluster.layout", "6 decoder layers", "model.num_layers is 7", "fix:"]),
    "E_misplaced": (["cluster.layout=tE|tt|tt|tL"], {}, ["cluster.layout", "'E'", "first token"]),
    "L_misplaced": (["cluster.layout=Et|tt|tt|Lt"], {}, ["cluster.layout", "'L'", "last token"]),
    "u_shape_one_stage": (["cluster.stages=[{name:a,device:cpu,tp:1}]", "cluster.layout=null"],
                          {}, ["cluster.u_shape=true needs at least 2 stages", "got 1"]),
    "unknown_device": (["cluster.stages.0.device=tpu"], {},
                       ["cluster.stages[0].device='tpu'", "cuda, npu, cpu"]),
    "device_missing": (["cluster=mixed_gpu_npu", "model=llama_7b"], {},
                       ["cluster.stages[0].device='cuda'", "this machine has only ['cpu']"]),
    "dp_zero": (["cluster.dp=0"], {}, ["cluster.dp=0 must be >= 1"]),
    "chunks_ldt_runtime": (["cluster=cpu_uniform", "cluster.layout=Ett|t|t|ttL",
                            "train.runtime=ldt"], {},
                           ["cluster.layout has 2 chunks per stage", "only megatron's interleaved",
                            "train.runtime=ldt runs one chunk per stage", "train.runtime=auto"]),
    "chunks_one_stage": (["cluster.stages=[{name:a,device:cpu,tp:1}]", "cluster.u_shape=false",
                          "cluster.layout=Ettt|tttL"], {},
                         ["2 chunks per stage", "one stage has no pipeline to interleave"]),
    "cost_inventory_not_zb": (["train.cost_inventory=cpu_elastic"], {},
                              ["train.cost_inventory='cpu_elastic' prices the zero-bubble order",
                               "give train.schedule=zb"]),
    "overlap_one_chunk": (["cluster=cpu_vtp", "train.overlap_p2p_comm=true"], {},
                          ["train.overlap_p2p_comm=true", "one segment per stage",
                           "several chunks per stage"]),
    "sgd_distributed": (["train/optimizer=sgd", "train.distributed_optimizer=true"], {},
                        ["train.distributed_optimizer=true with train/optimizer=sgd",
                         "shards Adam only", "train.distributed_optimizer=false"]),
    "verify_torchrun": (["train.verify=true"], {"WORLD_SIZE": "4", "RANK": "0"},
                        ["train.verify=true under torchrun", "ldt-train on one machine"]),
    "snapshot_dir_missing": (["train.snapshot_dir={tmp}/absent"], {},
                             ["train.snapshot_dir=", "absent' is not a folder this process can "
                              "write", "e.g. /dev/shm"]),
    "typo_key": (["+cluster.stages.0.devise=cpu"], {}, ["devise"]),
    "interleaved_one_chunk": (["cluster=cpu_vtp", "train.schedule=interleaved"], {},
                              ["train.schedule=interleaved needs several chunks per stage",
                               "k * 3 segments", "Et|t|t|t|t|tL"]),
    "interleaved_m": (["cluster=cpu_vtp", "train.schedule=interleaved",
                       "cluster.layout=Et|t|t|t|t|tL", "train.num_microbatches=4"], {},
                      ["train.num_microbatches=4", "multiple of the stage count", "use 6"]),
    "zb_interleaved": (["cluster=cpu_vtp", "train.schedule=zb", "cluster.layout=Et|t|t|t|t|tL"],
                       {}, ["train.schedule=zb", "2 chunks per stage", "one segment per stage"]),
    "zb_megatron": (["cluster=cpu_vtp", "train.schedule=zb", "train.runtime=megatron"], {},
                    ["train.schedule=zb (zero-bubble)", "train.runtime=megatron",
                     "train.runtime=auto or ldt"]),
    "ushape_1f1b": (["train.schedule=1f1b"], {},
                    ["train.schedule='1f1b' with cluster.u_shape=true", "its own schedule",
                     "use train.schedule=auto (or zb)"]),
    "ushape_megatron": (["train.runtime=megatron"], {},
                        ["train.runtime=megatron with cluster.u_shape=true",
                         "give train.runtime=auto or ldt"]),
    "bucket_without_overlap": (["train.ddp_bucket_size=1000"], {},
                               ["train.ddp_bucket_size=1000", "train.overlap_grad_reduce=false",
                                "give train.overlap_grad_reduce=true"]),
    "cost_run_not_zb": (["train.cost_run=outputs/earlier"], {},
                        ["train.cost_run='outputs/earlier' prices the zero-bubble order",
                         "train.schedule='auto'", "give train.schedule=zb"]),
    "cost_run_elastic": (["cluster=cpu_elastic", "run_dir=elastic", "train.schedule=zb",
                          "train.cost_run=outputs/earlier"], {},
                         ["train.cost_run='outputs/earlier' prices the zero-bubble order with "
                          "one cluster's measured ops", "cluster.inventory='cpu_elastic'",
                          "leave train.cost_run out"]),
    "elastic_stages": (["cluster.inventory=cpu_elastic", "run_dir=elastic"], {},
                       ["cluster.stages=['edge', 'cloud0', 'cloud1']",
                        "cluster.inventory='cpu_elastic'", "its stages anew at every start",
                        "leave cluster.stages empty"]),
    "elastic_layout": (["cluster=cpu_elastic", "run_dir=elastic", "cluster.layout=Et|tttt|tL"],
                       {}, ["cluster.layout='Et|tttt|tL'", "leave cluster.layout out"]),
    "elastic_schedule": (["cluster=cpu_elastic", "run_dir=elastic", "train.schedule=1f1b"], {},
                         ["train.schedule='1f1b'", "the schedule of each world",
                          "give train.schedule=auto (or zb"]),
    "elastic_link_delays": (["cluster=cpu_elastic", "run_dir=elastic",
                             "cluster.link_delay_ms=[1,2,3]"], {},
                            ["cluster.link_delay_ms=[1, 2, 3]", "the number of boundaries",
                             "give one number for every boundary"]),
    "elastic_mtp": (["cluster=cpu_elastic", "run_dir=elastic", "model.mtp_num_layers=1"], {},
                    ["model.mtp_num_layers=1", "does not place MTP layers",
                     "set model.mtp_num_layers=0"]),
    "eval_negative": (["train.eval_every=-1"], {},
                      ["train.eval_every=-1 must be >= 0", "0: no evaluation"]),
    # issue #12: accepted, or refused late and raw, before
    "steps_zero": (["train.steps=0"], {}, ["train.steps=0 must be >= 1"]),
    "steps_negative": (["train.steps=-3"], {}, ["train.steps=-3 must be >= 1"]),
    "seq_length_zero": (["model.seq_length=0"], {}, ["model.seq_length=0 must be >= 1"]),
    "num_layers_zero": (["model.num_layers=0"], {}, ["model.num_layers=0 must be >= 1"]),
    "hidden_not_heads_multiple": (["model.hidden_size=66"], {},
                                  ["model.hidden_size=66", "model.num_attention_heads=4",
                                   "hidden_size=64 or 68"]),
    "gqa_groups": (["model.num_query_groups=3"], {},
                   ["model.num_query_groups=3 does not divide model.num_attention_heads=4"]),
    "positions_short": (["model.max_position_embeddings=32"], {},
                        ["model.max_position_embeddings=32 < model.seq_length=64"]),
    "vocab_below_bytes": (["model.vocab_size=128"], {}, ["model.vocab_size=128", ">= 256"]),
    "data_missing": (["data.path={tmp}/nope.txt"], {}, ["data.path=", "nope.txt",
                                                        "no such file or folder"]),
    "data_empty": (["data.path={tmp}/empty.txt"], {}, ["data.path=", "empty.txt", "0 bytes"]),
    "data_small": (["data.path={tmp}/small.txt"], {},
                   ["data.path=", "small.txt", "2000 bytes", "train.micro_batch_size=2",
                    "model.seq_length=64", "needs >= 2561 bytes"]),
    "data_max_bytes": (["data.max_bytes=100"], {}, ["built-in corpus", "data.max_bytes=100"]),
    "lr_nan": (["train.lr=nan"], {}, ["train.lr=nan must be a finite number >= 0"]),
    "lr_inf": (["train.lr=inf"], {}, ["train.lr=inf must be a finite number >= 0"]),
    "lr_negative": (["train.lr=-0.1"], {}, ["train.lr=-0.1 must be a finite number >= 0"]),
    "min_lr_above_lr": (["train.min_lr=0.01"], {}, ["train.min_lr=0.01 > train.lr=0.001"]),
    "warmup_negative": (["train.warmup_steps=-1"], {}, ["train.warmup_steps=-1 must be >= 0"]),
    "log_interval_zero": (["train.log_interval=0"], {}, ["train.log_interval=0 must be >= 1"]),
    "snapshot_every_zero": (["train.snapshot_every=0"], {},
                            ["train.snapshot_every=0 must be >= 1",
                             "1 snapshots after every step"]),
    "layout_empty_segment": (["cluster.layout=Et||tttt|tL"], {},
                             ["cluster.layout", "segment 1 (empty)", "position 2", "fix:"]),
    "layout_chunk_without_layer": (["cluster.layout=E|ttt|ttt|L"], {},
                                   ["cluster.layout", "segment 0 (E)", "0 decoder layers"]),
    "too_few_layers": (["model.num_layers=3", "cluster.layout=null"], {},
                       ["model.num_layers", "4 chunks", ">= 4"]),
    "unknown_key_added": (["+train.unknown_key=1"], {},
                          ["train.unknown_key=1: train.unknown_key is not a config key"]),
    "unknown_key": (["train.unknown_key=1"], {},
                    ["train.unknown_key=1: train.unknown_key is not a config key; the keys of "
                     "train: steps, micro_batch_size,"]),
    "misspelt_key": (["train.stpes=5"], {}, ["train.stpes=5: ", "did you mean train.steps=5?"]),
    "misspelt_key_added": (["+train.stpes=5"], {}, ["did you mean train.steps=5?"]),
    "misspelt_group": (["trian.steps=5"], {}, ["did you mean train.steps=5?"]),
    "misspelt_stage_key": (["cluster.stages.1.tpp=2"], {}, ["did you mean cluster.stages.1.tp=2?"]),
    "mtp_token_without_mtp_layers": (["cluster.layout=Et|tt|tt|tmL"], {},
                                     ["has 1 MTP layers ('m') but model.mtp_num_layers is 0",
                                      "set model.mtp_num_layers=1"]),
    "mtp_on_a_plain_pipeline": (["cluster=cpu_vtp", "model.mtp_num_layers=1"], {},
                                ["model.mtp_num_layers=1 on a plain pipeline of 3 stages",
                                 "cluster.u_shape=true"]),
    "mtp_before_a_decoder_layer": (["model.mtp_num_layers=1", "cluster.layout=Et|tt|ttm|tL"],
                                   {}, ["'m' (MTP layer) must come after every decoder layer"]),
    "mtp_negative": (["model.mtp_num_layers=-1"], {}, ["model.mtp_num_layers=-1 must be >= 0"]),
    "resume_missing": (["train.resume={tmp}/no_such_run"], {},
                       ["train.resume=", "no_such_run", "does not exist"]),
    "resume_incomplete": (["train.resume={tmp}/unfinished"], {},
                          ["train.resume=", "unfinished", "no complete checkpoint"]),
    "comm_timeout_zero": (["train.comm_timeout_s=0"], {},
                          ["train.comm_timeout_s=0.0 must be a finite number of seconds > 0"]),
    "comm_timeout_negative": (["train.comm_timeout_s=-5"], {}, ["train.comm_timeout_s=-5.0"]),
    # issue #26: resume=auto needs a run folder that is the same at every start; elastic torchrun
    "resume_auto_no_run_dir": (["train.resume=auto"], {},
                               ["train.resume=auto", "same at every start", "run_dir=DIR"]),
    "elastic_bare": (["cluster=cpu_elastic", "run_dir=out"], {},
                     ["cluster.inventory (elastic)", "RANK is not set", "torchrun --nnodes"]),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The data files and run folders the cases point at ({tmp})."""
    tmp = tmp_path_factory.mktemp("inputs")
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "small.txt").write_bytes(b"x" * 2000)
    step = tmp / "unfinished" / "checkpoints" / "step_0000002" / "stage_0"
    step.mkdir(parents=True)  # a save that never wrote its COMPLETE marker
    return tmp


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_config_is_refused(name, files, tmp_path, monkeypatch):
    overrides, env, expected = CASES[name]
    args = [o.replace("{tmp}", str(files)) for o in overrides]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    if "RANK" in env:  # a torchrun rank: a refusal leaves by os._exit
        proc = run_train(*args, own_process=True, timeout=90, cwd=tmp_path,
                         env={**os.environ, **env})
    else:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(tmp_path)
        proc = run_train(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if name.startswith(("unknown_key", "misspelt")):  # ldt's one line, not Hydra's eight
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # validation comes before any world: no rank started (each records its pid in run_dir/pids)
    assert not [p for p in tmp_path.rglob("pids")], "a rank started before the refusal"
    assert not list(tmp_path.iterdir()), "a refused config must leave no run folder behind"


def test_unknown_key_names_the_closest_key_at_its_level():
    from ldt.config import unknown_key

    assert unknown_key("train.steps") is None and unknown_key("run_dir") is None
    assert unknown_key("cluster.stages.3.dp") is None
    for below_a_value in ("train.peak_tflops.tpu", "data.blend.0", "cluster.link_delay_ms.1"):
        assert unknown_key(below_a_value) is None, below_a_value
    for key, closest in (("train.optimizer.adam_beta3", "train.optimizer.adam_beta2"),
                         ("train.optimzer.name", "train.optimizer.name"),
                         ("modl.hidden_size", "model.hidden_size"), ("rundir", "run_dir"),
                         ("steps", "train.steps")):
        assert f"did you mean {closest}=1?" in unknown_key(key, "1"), key
    assert unknown_key("xyzzy.a").startswith("xyzzy.a is not a config key; the keys of the "
                                             "config: cluster, model, train, data, run_dir")


def test_one_loader_refuses_an_unknown_key_where_it_is_in_every_group(tmp_path):
    """ldt.config.load is the one loader of typed YAML: a dict (the API), a cluster file, a
    shipped model or an inventory all refuse a key their schema lacks, naming its place (list
    index included), the dataclass, and the closest field."""
    from ldt.config import ConfigError, load_cluster_yaml, to_cluster
    from ldt.plan import load_inventory, load_model

    stages = [{"name": "a"}, {"name": "b", "devise": "cpu"}]
    with pytest.raises(ConfigError, match=r"^cluster\.stages\[1\]\.devise is not a field of "
                                          r"StageConfig; remove it, or did you mean 'device'\?"):
        to_cluster({"stages": stages})
    (tmp_path / "c.yaml").write_text("stages:\n  - {name: a, recompute: {granularty: full}}\n")
    with pytest.raises(ConfigError, match=r"^cluster\.stages\[0\]\.recompute\.granularty is not a "
                                          r"field of RecomputeConfig; remove it from .*c\.yaml, "
                                          r"or did you mean 'granularity'"):
        load_cluster_yaml(str(tmp_path / "c.yaml"))
    (tmp_path / "m.yaml").write_text("num_layers: 2\nhidden_size: 8\nnum_attention_heads: 2\n"
                                     "hiden_size: 8\n")
    with pytest.raises(ConfigError, match=r"^model\.hiden_size is not a field of ModelConfig; "
                                          r"remove it from .*m\.yaml, or did you mean "
                                          r"'hidden_size'"):
        load_model(str(tmp_path / "m.yaml"))
    (tmp_path / "i.yaml").write_text("kinds:\n  - {name: a, device: cpu, count: 1, tflops: 1, "
                                     "memory_gib: 8, intra_bw_gbps: 1}\nlinks:\n  - {a: a, b: a, "
                                     "bandwith_gbps: 1}\n")
    with pytest.raises(ConfigError, match=r"^inventory\.links\[0\]\.bandwith_gbps is not a "
                                          r"field of Link; remove it from .*i\.yaml.*"
                                          r"'bandwidth_gbps'.*ldt/plan/inventory\.py"):
        load_inventory(str(tmp_path / "i.yaml"))
    assert to_cluster({"stages": [{"name": "a", "recompute": {"granularity": "selective"}}]}
                      ).stages[0].recompute.granularity == "selective"  # known keys load


def test_validation_imports_neither_torch_nor_megatron(tmp_path):
    """A refused config answers before torch (1.4 s here) or megatron-core (4.5 s) load."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ldt.job.train",
                           "model.hidden_size=66"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    loaded = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()
              if line.startswith("import time:")}
    assert "hydra" in loaded  # the probe sees imports at all
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "megatron")}


def test_binary_data_file_is_a_warning(tmp_path):
    from ldt.config import DataConfig, ModelConfig, TrainConfig
    from ldt.topology.ranks import Topology
    from ldt.topology.validate import check_files

    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    topo = Topology.from_config({"stages": [{"name": "a"}]}, model)
    warnings = check_files(DataConfig(path=str(path)), model, TrainConfig(), topo)
    assert len(warnings) == 1 and "weights.bin" in warnings[0] and "binary" in warnings[0]
    text = tmp_path / "corpus.txt"
    text.write_text("plain text " * 1000)
    assert check_files(DataConfig(path=str(text)), model, TrainConfig(), topo) == []


def test_under_torchrun_each_host_needs_only_its_own_stages_devices():
    """A CPU edge host beside a GPU cloud host: under torchrun the edge's rank checks the edge's
    stage only (it refused the cloud's cuda, whose devices are on the other host, although
    that is what torchrun was launched for); the cloud's rank on this CPU machine is refused,
    and so is the whole cluster when one launcher runs every rank here."""
    from ldt.config import ConfigError
    from ldt.job.hydra import compose
    from ldt.topology.validate import validate

    model = compose(["model=gpt_tiny"]).model
    cluster = {"stages": [{"name": "edge", "device": "cpu", "tp": 1},
                          {"name": "cloud", "device": "cuda", "tp": 1}], "u_shape": True}
    assert validate(cluster, model, world_size=2, rank=0).num_stages == 2
    for rank in (1, None):
        with pytest.raises(ConfigError, match=r"cluster.stages\[1\].device='cuda' but this "
                                              r"machine has only \['cpu'\]"):
            validate(cluster, model, world_size=2, rank=rank)


def test_a_resume_with_another_optimizer_is_refused(tmp_path, monkeypatch):
    """A checkpoint says which optimizer wrote it: resuming an Adam run with SGD kept no
    momentum and dropped Adam's moments without a word. train.load (weights only) and a
    checkpoint that does not say (written before it did) pass."""
    import json

    from ldt.config import ConfigError, to_train
    from ldt.topology import validate as checks

    found = tmp_path / "checkpoints" / "step_5"
    found.mkdir(parents=True)
    info = {"step": 5, "steps": 10, "optimizer": "adam"}
    (found / "checkpoint.json").write_text(json.dumps(info))
    monkeypatch.setattr(checks, "preflight", lambda *a, **k: str(found))  # files: elsewhere
    monkeypatch.setattr(checks, "check_compatible", lambda *a: None)
    sgd = {"steps": 10, "optimizer": {"name": "sgd"}}
    with pytest.raises(ConfigError, match=r"was written by a train/optimizer=adam run, and this "
                                          r"run's is sgd.*train.load="):
        checks._check_checkpoint(to_train({**sgd, "resume": str(tmp_path)}), None)
    checks._check_checkpoint(to_train({**sgd, "load": str(tmp_path)}), None)
    checks._check_checkpoint(to_train({"steps": 10, "resume": str(tmp_path)}), None)  # adam
    (found / "checkpoint.json").write_text(json.dumps({"step": 5, "steps": 10}))
    checks._check_checkpoint(to_train({**sgd, "resume": str(tmp_path)}), None)
