"""ldt-plan / ldt-sim command lines (called in-process; one subprocess for ``python -m``)."""

import dataclasses
import json
import subprocess
import sys

import pytest

from ldt.config import load_cluster_yaml
from ldt.plan import load_model
from ldt.tools import plan as plan_tool
from ldt.tools import sim as sim_tool
from ldt.topology.validate import validate


def test_plan_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        plan_tool.main(["--help"])
    assert exc.value.code == 0
    assert "--inventory" in capsys.readouterr().out


def test_python_m_help_works():
    out = subprocess.run([sys.executable, "-m", "ldt.tools.plan", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "ldt-plan" in out.stdout


def test_plan_writes_valid_yaml_trace_and_png(tmp_path, capsys):
    out, trace, png = tmp_path / "c.yaml", tmp_path / "t.json", tmp_path / "t.png"
    rc = plan_tool.main(["--inventory", "edge_cloud", "--model", "llama_7b", "--global-batch", "32",
                         "--out", str(out), "--trace", str(trace), "--png", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "U-shape" in text and "iteration" in text
    validate(load_cluster_yaml(str(out)), load_model("llama_7b"), check_devices=False)
    assert json.loads(trace.read_text())
    assert png.stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "t.json", "t.png"]


def test_plan_out_creates_folders_and_a_train_file(tmp_path, capsys):
    """--out DIR/cluster/NAME.yaml: folders created, DIR/train/NAME.yaml has the micro-batches."""
    from ldt.job.hydra import compose

    out = tmp_path / "plans" / "cluster" / "mine.yaml"
    rc = plan_tool.main(["--inventory", "a100_910b", "--model", "llama_7b", "--out", str(out)])
    assert rc == 0
    assert f"--config-dir {tmp_path / 'plans'} cluster=mine train=mine" in capsys.readouterr().out
    assert plan_tool.main(["--inventory", "a100_910b", "--model", "llama_7b", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    cfg = compose([f"hydra.searchpath=[file://{tmp_path / 'plans'}]", "cluster=mine",
                   "train=mine", "model=llama_7b"])
    assert cfg.train.num_microbatches == planned["num_microbatches"]
    assert cfg.train.micro_batch_size == 1 and cfg.train.steps == 50  # the rest: train/default
    assert cfg.cluster.dp == planned["cluster"]["dp"]


def test_sim_of_a_plan_takes_the_planned_micro_batches(tmp_path, capsys):
    """ldt-sim --cluster DIR/cluster/NAME.yaml reads -m, --mbs and --prefetch from the
    DIR/train/NAME.yaml ldt-plan wrote, and so prices the plan as the planner did."""
    out = tmp_path / "plans" / "cluster" / "mine.yaml"
    planning = ["--inventory", "edge_cloud", "--model", "llama_7b", "--mbs", "2",
                "--global-batch", "32"]
    assert plan_tool.main([*planning, "--out", str(out)]) == 0
    capsys.readouterr()
    assert plan_tool.main([*planning, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    args = ["--cluster", str(out), "--model", "llama_7b", "--inventory", "edge_cloud", "--json"]
    assert sim_tool.main(args) == 0
    captured = capsys.readouterr()
    simulated = json.loads(captured.out)
    assert f"num_microbatches={planned['num_microbatches']}, micro_batch_size=2" in captured.err
    assert simulated["num_microbatches"] == planned["num_microbatches"]
    assert simulated["iteration_time_s"] == pytest.approx(planned["iteration_time_s"], rel=1e-9)
    assert sim_tool.main([*args, "-m", str(planned["num_microbatches"] + 1)]) == 0  # given wins
    assert json.loads(capsys.readouterr().out)["num_microbatches"] == planned[
        "num_microbatches"] + 1
    (tmp_path / "plans" / "train" / "mine.yaml").unlink()  # no train file: -m is required
    with pytest.raises(SystemExit):
        sim_tool.main(args)
    assert "--num-microbatches required" in capsys.readouterr().err


def test_sim_of_a_zero_bubble_plan_takes_the_planned_schedule(tmp_path, capsys):
    """A plan ldt-plan picked on its zero-bubble schedule (llama_7b on edge_cloud with its
    cloud cards on cuda, fused attention there): ldt-sim reads ``schedule: zb`` from its train
    file and prices the same iteration; ``--schedule auto`` prices today's schedule, slower."""
    from ldt.config.load import conf_path

    inventory = tmp_path / "edge_cloud_cuda.yaml"
    with open(conf_path("edge_cloud", "inventory")) as f:
        text = f.read()
    inventory.write_text(text.replace("device: npu", "device: cuda"))
    out = tmp_path / "plans" / "cluster" / "zb.yaml"
    planning = ["--inventory", str(inventory), "--model", "llama_7b"]
    assert plan_tool.main([*planning, "--out", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["schedule"] == "zb"
    args = ["--cluster", str(out), "--model", "llama_7b", "--inventory", str(inventory),
            "--json"]
    assert sim_tool.main(args) == 0
    captured = capsys.readouterr()
    assert "schedule=zb" in captured.err
    simulated = json.loads(captured.out)
    assert simulated["schedule"] == "zb"
    assert simulated["iteration_time_s"] == pytest.approx(planned["iteration_time_s"], rel=1e-9)
    assert sim_tool.main([*args, "--schedule", "auto"]) == 0
    today = json.loads(capsys.readouterr().out)
    assert today["schedule"] == "auto" and today["iteration_time_s"] > planned["iteration_time_s"]
    # zb as planned, with prefetch 1 (receives posted ahead over the edge's slow links,
    # forwards run ahead): without it, slower
    assert planned["prefetch"] == 1
    assert sim_tool.main([*args, "--prefetch", "0"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert flat["schedule"] == "zb" and flat["iteration_time_s"] > planned["iteration_time_s"]


def test_plan_json(capsys):
    rc = plan_tool.main(["--inventory", "a100_910b", "--model", "llama_7b", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["iteration_time_s"] > 0
    assert data["cluster"]["dp"] * data["num_microbatches"] == 64
    assert len(data["stages"]) == len(data["cluster"]["stages"])


def test_plan_bad_input_is_exit_2(capsys):
    rc = plan_tool.main(["--inventory", "no_such_inventory", "--model", "llama_7b"])
    assert rc == 2
    assert "no_such_inventory" in capsys.readouterr().err


def test_plan_shows_the_front_and_takes_prices_and_the_objective(tmp_path, capsys):
    """A priced inventory file: the table shows the time/cost front with the pick marked and
    says why; --objective cost picks the cheap kind; --json carries the front; a contradictory
    objective is exit 2 with the fix."""
    inv = tmp_path / "priced.yaml"
    inv.write_text(
        "name: priced\nkinds:\n"
        "  - {name: fast, device: cuda, count: 4, tflops: 989, memory_gib: 80, intra_bw_gbps: 450,"
        " node_size: 4, price_per_hour: 10}\n"
        "  - {name: slow, device: cuda, count: 4, tflops: 125, memory_gib: 32, intra_bw_gbps: 150,"
        " node_size: 4, price_per_hour: 1}\n"
        "links:\n  - {a: fast, b: slow, bandwidth_gbps: 12.5, latency_us: 30}\n")
    args = ["--inventory", str(inv), "--model", "gpt_tiny", "--global-batch", "8"]
    assert plan_tool.main(args) == 0
    text = capsys.readouterr().out
    assert "time/cost front:" in text and "price_per_hour x hours" in text
    picked = [line for line in text.splitlines() if line.startswith("*")]
    assert len(picked) == 1 and "fast/tp" in picked[0], text
    assert "picked" in text and "(objective: fastest, then cheapest within 1.0% of it)" in text
    assert plan_tool.main([*args, "--objective", "cost", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {s["device"] for s in data["cluster"]["stages"]} == {"cuda"}
    assert data["objective"] == {"minimise": "cost", "tolerance": 0.01}
    assert [row["picked"] for row in data["front"]].count(True) == 1
    assert data["front"][-1]["kinds"] == ["slow"] * len(data["front"][-1]["kinds"])
    assert data["cost_per_step"] == min(row["cost_per_step"] for row in data["front"])
    assert plan_tool.main([*args, "--objective", "cost", "--max-slowdown", "0.05"]) == 2
    assert "goes with --objective time" in capsys.readouterr().err


def test_sim_table_and_json(capsys):
    args = ["--cluster", "mixed_gpu_npu", "--model", "llama_7b", "--inventory", "a100_910b",
            "-m", "8"]
    assert sim_tool.main(args) == 0
    assert "pipeline: 3 stages" in capsys.readouterr().out
    assert sim_tool.main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert 0 < data["bubble_fraction"] < 1
    assert [s["tp"] for s in data["stages"]] == [4, 8, 8]


def test_sim_ambiguous_kind_asks_for_kinds(capsys):
    rc = sim_tool.main(["--cluster", "mixed_gpu_npu", "--model", "llama_7b", "--inventory",
                        "a100_910b", "-m", "4", "--kinds", "a100,a100,ascend910b"])
    assert rc == 2
    assert "--kinds[1]='a100'" in capsys.readouterr().err


def test_a_per_stage_dp_timeline_names_each_lane_it_draws():
    """With per-stage dp the simulated timeline has a row per lane the plan prices (one
    group of replicas): each named by its stage and replica, not the stages' names in turn
    (the second a100 lane was drawn as ascend910b_0, the last lane unnamed)."""
    from ldt.plan.clusters import timeline_rows
    from ldt.plan.evaluate import Plan, StageSpec

    plan = Plan((StageSpec("a100", 1), StageSpec("ascend910b", 2), StageSpec("ascend910b", 2)),
                (4, 14, 14), False, 8, 16, stage_dp=(8, 4, 4))
    assert timeline_rows(plan) == ["a100_0 r0", "a100_0 r1", "ascend910b_0 r0",
                                   "ascend910b_1 r0"]
    assert timeline_rows(dataclasses.replace(plan, stage_dp=())) == [
        "a100_0", "ascend910b_0", "ascend910b_1"]


def test_the_kinds_of_a_planned_clusters_stages_come_from_their_names():
    """Two kinds of one device type (the edge's A100 and the cloud's): a cluster ldt-plan
    wrote names its stages KIND_n, so ldt-sim prices them as planned without --kinds; a
    hand-written one is refused with an example of one kind per stage."""
    from ldt.config import ConfigError, to_cluster
    from ldt.plan import load_inventory
    from ldt.plan.clusters import stage_kinds

    inventory = load_inventory("edge_one_card")
    stages = [{"name": n, "device": "cuda", "tp": 1} for n in ("edge", "a100_0", "a100_1")]
    planned = to_cluster({"stages": stages, "u_shape": True})
    assert stage_kinds(planned, inventory) == ["edge_gpu", "a100", "a100"]
    by_hand = to_cluster({"stages": [dict(s, name=f"s{i}") for i, s in enumerate(stages)],
                          "u_shape": False})
    with pytest.raises(ConfigError, match=r"--kinds edge_gpu,edge_gpu,edge_gpu\)"):
        stage_kinds(by_hand, inventory)


def test_the_train_line_carries_what_the_plan_was_priced_with(tmp_path, capsys):
    """--dtype and --sequence-parallel change what a plan needs; ldt-train must run that same
    model, so the printed command (and the files' headers) carry them as model overrides, and
    they compose to the priced model. (They were priced, then dropped: the run trained
    llama_7b in its file's bfloat16 without sequence parallelism.)"""
    import shlex

    from ldt.job.hydra import compose

    out = tmp_path / "plans" / "cluster" / "fp32.yaml"
    rc = plan_tool.main(["--inventory", "a100_910b", "--model", "llama_7b", "--dtype",
                         "float32", "--sequence-parallel", "--out", str(out)])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("train it: "))
    words = shlex.split(line[len("train it: "):])
    assert words[-2:] == ["model.params_dtype=float32", "model.sequence_parallel=true"]
    cfg = compose([f"hydra.searchpath=[file://{tmp_path / 'plans'}]", *words[3:]])
    assert cfg.model.params_dtype == "float32" and cfg.model.sequence_parallel is True
    assert "model.params_dtype=float32 model.sequence_parallel=true" in out.read_text()
    train = (tmp_path / "plans" / "train" / "fp32.yaml").read_text()
    assert "# Priced with model.params_dtype=float32 model.sequence_parallel=true" in train
    assert plan_tool.main(["--inventory", "a100_910b", "--model", "llama_7b", "--dtype",
                           "bfloat16"]) == 0  # the model's own dtype: nothing to add
    assert "model.params_dtype" not in capsys.readouterr().out
    # --no-flash prices local attention everywhere: the run is told to build local layers
    local = tmp_path / "plans" / "cluster" / "local.yaml"
    assert plan_tool.main(["--inventory", "a100_910b", "--model", "llama_7b", "--no-flash",
                           "--out", str(local)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("model=llama_7b model.transformer_impl=local")


def test_a_reader_that_stops_reading_gets_no_error_message():
    """``ldt-plan ... | head -1``: the reader closes the pipe; the tool stops quietly (exit
    128 + SIGPIPE, like a shell tool) instead of blaming a path it never opened."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "ldt.tools.plan", "--inventory", "cpu_local",
                             "--model", "gpt_tiny"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the tool prints its first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE and err == "", err


def test_sim_prices_a_plan_with_plan_s_dtype_and_sequence_parallelism(tmp_path, capsys):
    """ldt-plan --dtype --sequence-parallel, then ldt-sim on its files, with the same two flags
    or without them (taken from the train file's header, and said): the same memory per stage
    and the same iteration. A cluster file away from its train file is priced as the model
    file says (ldt-sim once did that beside the train file too: a100_910b llama_7b's first
    stage 45.53 GiB planned, 51.67 simulated)."""
    import shutil

    out = tmp_path / "plans" / "cluster" / "sp.yaml"
    flags = ["--dtype", "float32", "--sequence-parallel"]
    assert plan_tool.main(["--inventory", "a100_910b", "--model", "llama_7b", *flags,
                           "--out", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    args = ["--cluster", str(out), "--model", "llama_7b", "--inventory", "a100_910b", "--json"]
    assert sim_tool.main([*args, *flags]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert [s["memory_gib"] for s in simulated["stages"]] == \
        [s["memory_gib"] for s in planned["stages"]]
    assert simulated["iteration_time_s"] == pytest.approx(planned["iteration_time_s"], rel=1e-9)
    assert sim_tool.main(args) == 0  # from the train file's header
    taken = capsys.readouterr()
    assert json.loads(taken.out) == simulated
    assert "model.params_dtype=float32, model.sequence_parallel=true from " in taken.err, \
        taken.err
    alone = tmp_path / "sp.yaml"
    shutil.copy(out, alone)
    assert sim_tool.main(["--cluster", str(alone), *args[2:], "-m", str(planned[
        "num_microbatches"])]) == 0  # no train file: the model file's bf16, no SP
    other = json.loads(capsys.readouterr().out)
    assert [s["memory_gib"] for s in other["stages"]] != \
        [s["memory_gib"] for s in planned["stages"]]


def test_sim_refuses_mtp_layers_it_would_price_as_free(tmp_path, capsys):
    """The cost model has no MTP layers: ldt-sim priced a layout with 'm' exactly as the same
    layout without it (gpt_tiny, one MTP layer: the same time and memory either way). Refused in one line."""
    import yaml

    from ldt.config.load import conf_path, config_dict

    model = tmp_path / "gpt_mtp.yaml"
    model.write_text(yaml.safe_dump({**config_dict(load_model("gpt_tiny")), "name": "gpt_mtp",
                                     "mtp_num_layers": 1}))
    cluster = tmp_path / "mtp.yaml"
    demo = config_dict(load_cluster_yaml(conf_path("cpu_demo", "cluster")))
    cluster.write_text(yaml.safe_dump({**demo, "layout": "Et|tt|tt|tmL"}))
    rc = sim_tool.main(["--cluster", str(cluster), "--model", str(model), "--inventory",
                        "cpu_local", "-m", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.mtp_num_layers=1: ldt-sim does not price MTP layers" in err, err
