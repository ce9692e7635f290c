"""Checkpoints: train, save, kill, resume -> the same losses as an uninterrupted run.

The kill is a SIGKILL of the whole `ldt-train` process group right after a checkpoint is
complete, while the run goes on; resuming from the run folder picks the newest complete
checkpoint. A resume into another layout (other stages and TP sizes) continues exactly too,
since checkpoints hold full tensors under global names.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

STEPS = 24


def run(run_dir, *overrides, timeout=240):
    proc = subprocess.run([sys.executable, "-m", "ldt.train", f"run_dir={run_dir}",
                           f"train.steps={STEPS}", *overrides],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(os.path.join(run_dir, "metrics.csv")) as f:  # one row per step of this run
        summary["losses"] = [float(r["loss"]) for r in csv.DictReader(f)]
    return summary


@pytest.mark.timeout(400)
def test_kill_then_resume_gives_the_same_losses(tmp_path):
    full = run(tmp_path / "full")
    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "ldt.train", f"run_dir={killed_dir}",
                             f"train.steps={STEPS}", "train.save_every=2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    marker = killed_dir / "checkpoints" / "step_0000003" / "COMPLETE"
    deadline = time.monotonic() + 180
    while not marker.exists():
        assert proc.poll() is None, "run ended before its second checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    resumed = run(tmp_path / "resumed", f"train.resume={killed_dir}")
    start = resumed["first_step"]
    assert 4 <= start < STEPS, resumed
    assert resumed["losses"] == pytest.approx(full["losses"][start:], abs=1e-6)


@pytest.mark.timeout(400)
def test_resume_into_another_layout(tmp_path):
    first = run(tmp_path / "a", "train.save_every=12")
    step_dir = tmp_path / "a" / "checkpoints" / "step_0000011"
    other = run(tmp_path / "b", "cluster=cpu_vtp", f"train.resume={step_dir}")
    assert other["first_step"] == 12
    assert other["losses"] == pytest.approx(first["losses"][12:], abs=1e-5)


def test_incomplete_checkpoint_is_refused(tmp_path):
    from ldt.training import checkpoint

    (tmp_path / "checkpoints" / "step_0000001" / "stage_0").mkdir(parents=True)
    assert checkpoint.latest(str(tmp_path)) is None  # no COMPLETE marker: never loaded
