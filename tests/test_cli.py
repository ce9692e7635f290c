"""`ldt-train` and `ldt-rankmap` are Hydra apps with Hydra's own command line.

Every call is a subprocess with a timeout, run in a fresh folder (so a run folder left behind
would be seen). Only the multirun test starts worlds (two short runs, one after another).
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

LDT_TRAIN = os.path.join(os.path.dirname(sys.executable), "ldt-train")


def run(cwd, *args, timeout=60, module=None):
    cmd = [sys.executable, "-m", module] if module else [LDT_TRAIN]
    return subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_groups_and_switches(tmp_path, flag):
    proc = run(tmp_path, flag)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for text in ("ldt-train [FLAGS]", "cluster: base_cluster, cpu_demo, cpu_elastic, cpu_uniform, cpu_vdp,",
                 "model: base_model, gpt_tiny, llama3.1_8b, llama3_8b, llama_7b, llama_tiny,",
                 "train.verify=true", "train.resume=",
                 "run_dir=DIR", "--multirun", "--config-dir", "--cfg"):
        assert text in proc.stdout, text
    assert not list(tmp_path.iterdir())


def test_cfg_job_prints_the_composed_config(tmp_path):
    proc = run(tmp_path, "--cfg", "job", "cluster=cpu_vtp", "train.steps=7")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["train"]["steps"] == 7
    assert [s["tp"] for s in cfg["cluster"]["stages"]] == [2, 1, 2]
    assert cfg["model"]["name"] == "gpt_tiny" and "hydra" not in cfg
    assert not list(tmp_path.iterdir())


def test_info_config_dir_and_config_name(tmp_path):
    proc = run(tmp_path, "--info", "searchpath")
    assert proc.returncode == 0 and "pkg://ldt.conf" in proc.stdout, proc.stderr[-2000:]
    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "mine.yaml").write_text(
        "defaults: [base_cluster]\nstages: [{name: a, tp: 1}, {name: b, tp: 1}]\n")
    (conf / "exp.yaml").write_text(  # a primary config on top of ldt's own
        "defaults:\n  - config\n  - override cluster: mine\n  - _self_\ntrain:\n  steps: 3\n")
    proc = run(tmp_path, "--config-dir", str(conf), "--config-name", "exp", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["train"]["steps"] == 3
    assert [s["name"] for s in cfg["cluster"]["stages"]] == ["a", "b"]
    proc = run(tmp_path, "--config-dir", str(conf), "cluster=mine", "--cfg", "job")
    assert [s["name"] for s in yaml.safe_load(proc.stdout)["cluster"]["stages"]] == ["a", "b"]


def test_hydra_refusing_the_command_line_is_exit_2(tmp_path):
    proc = run(tmp_path, "cluster=no_such_cluster")
    assert proc.returncode == 2 and "cluster/no_such_cluster" in proc.stderr, proc.stderr
    proc = run(tmp_path, "train.stpes=5")  # ldt's one line, before Hydra's eight
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "did you mean train.steps=5?" in proc.stderr


def test_relative_paths_are_from_where_ldt_train_started(tmp_path):
    """hydra.job.chdir=true moves the job into its run folder; data.path stays relative to the
    folder ldt-train was started in (here: found, and refused as too small, not 'missing')."""
    (tmp_path / "small.txt").write_text("tiny")
    proc = run(tmp_path, "hydra.job.chdir=true", "data.path=small.txt")
    assert proc.returncode == 2, proc.stderr
    assert f"data.path='{tmp_path / 'small.txt'}' gives 4 bytes" in proc.stderr


def test_multirun_of_bad_configs_runs_every_job_and_exits_2(tmp_path):
    proc = run(tmp_path, "-m", "model.seq_length=0,-1", f"run_dir={tmp_path / 'sweep'}")
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "model.seq_length=0 must be" in proc.stderr
    assert "model.seq_length=-1 must be" in proc.stderr  # the sweep went on after job 0
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["multirun.yaml"]


def test_topology_is_a_hydra_app_that_writes_nothing(tmp_path):
    proc = run(tmp_path, "cluster=mixed_gpu_npu", "model=llama_7b", module="ldt.tools.rankmap")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 stages, TP [4, 8, 8], dp 1, world 20" in proc.stdout
    assert "0->1:host_staged" in proc.stdout
    proc = run(tmp_path, "--help", module="ldt.tools.rankmap")
    assert proc.returncode == 0 and "ldt-rankmap" in proc.stdout
    proc = run(tmp_path, "model.hidden_size=66", module="ldt.tools.rankmap")
    assert proc.returncode == 2 and "model.hidden_size=66" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(300)
def test_multirun_runs_each_job_in_its_own_folder(tmp_path):
    """-m: full ldt runs one after another, in run_dir/0, run_dir/1; each prints what it
    starts at once and ends with its JSON summary line (the last line of stdout is job 1's)."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([LDT_TRAIN, "-m", "cluster=cpu_demo,cpu_vtp", "train.steps=2",
                             f"run_dir={sweep}"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines, early = [], None
        for line in proc.stdout:
            if early is None and line.startswith("ldt-train: cluster=cpu_demo"):
                early = proc.poll() is None and not (sweep / "1").exists()
            lines.append(line.rstrip("\n"))
        err = proc.stderr.read()
        assert proc.wait(timeout=240) == 0, ("\n".join(lines)[-3000:], err[-3000:])
    finally:
        proc.kill()
    # printed at once (read while job 0 still ran, before job 1 began), not at the end
    assert early, lines[:3]
    summaries = [json.loads(x) for x in lines if x.startswith("{")]
    assert [s["run_dir"] for s in summaries] == [str(sweep / "0"), str(sweep / "1")]
    assert json.loads(lines[-1]) == summaries[-1]
    assert all(s["steps"] == 2 and s["final_loss"] > 0 for s in summaries)
    for job, cluster in ((0, "cpu_demo"), (1, "cpu_vtp")):
        folder = sweep / str(job)
        assert f"cluster={cluster}" in (folder / ".hydra" / "overrides.yaml").read_text()
        assert len((folder / "metrics.csv").read_text().splitlines()) == 3  # header + 2 steps
        assert yaml.safe_load((folder / "config.yaml").read_text())["run_dir"] == str(folder)
    assert (sweep / "multirun.yaml").exists()
    assert "world 5" in "\n".join(lines)  # cpu_vtp's rank map


def test_a_stop_signal_ends_a_multirun_not_only_its_job(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) during a multirun: the job it stopped exits 130 and no later job
    starts (Hydra's launcher started the next one, a Ctrl-C per job); a KeyboardInterrupt
    before a job's world is one line and 130, not a traceback."""
    from ldt.job.hydra import run_app

    monkeypatch.chdir(tmp_path)
    ran = []

    def stopped(cfg):
        ran.append(cfg.train.steps)
        return 130

    assert run_app(stopped, ["-m", "train.steps=1,2,3"], run_folder=False) == 130
    assert ran == [1]

    def interrupted(cfg):
        raise KeyboardInterrupt

    assert run_app(interrupted, ["train.steps=1"], run_folder=False) == 130
