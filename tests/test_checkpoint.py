"""Checkpoints and stops: nothing lost, nothing orphaned, nothing damaged loads.

One uninterrupted 24-step run (saving every 5 steps and after the last one, keeping the last
2) is the yardstick: a run stopped by SIGTERM, resumed, killed with SIGKILL, and resumed again
into the same run folder (from its snapshot in host memory, newer than its checkpoint) must end
with the same losses and one metrics.csv row per step; so must a resume from
the checkpoint before a save that found the disk full, and a resume into another layout
(checkpoints hold full tensors under global names). A damaged, truncated, mismatched or
finished checkpoint is refused on the launcher (exit 2, one line naming the file or the
parameter) before any rank starts.
"""

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ldt.storage import checkpoint_files as files
from train_cli import run_train

STEPS = 24


def ldt_train(run_dir, *overrides, steps=STEPS):
    return [sys.executable, "-m", "ldt.job.train", f"run_dir={run_dir}", f"train.steps={steps}",
            *overrides]


def run(run_dir, *overrides, steps=STEPS, own_process=False):
    """``ldt-train`` to its end (tests/train_cli.py; ``own_process`` where the test reads what
    the ranks print): its summary, with every step's loss and what was printed."""
    done = run_train(f"run_dir={run_dir}", f"train.steps={steps}", *overrides,
                     own_process=own_process)
    summary = done.summary()
    summary["losses"] = [loss for _, loss in metrics(run_dir)]  # one row per step of this run
    summary["stderr"], summary["stdout"] = done.stderr, done.stdout
    return summary


def metrics(run_dir) -> list[tuple[int, float]]:
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]


def _rows(run_dir) -> int:
    """metrics.csv's rows, 0 while it is being rewritten (a resume keeps the earlier ones)."""
    try:
        return len(metrics(run_dir))
    except (OSError, ValueError, KeyError):
        return 0


def session_processes(sid: int) -> list[int]:
    """Live processes of a session (the launcher started with start_new_session=True, its
    forkserver, resource tracker and ranks)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def assert_nothing_left(sid: int, within_s: float = 10.0) -> None:
    end = time.monotonic() + within_s
    while session_processes(sid) and time.monotonic() < end:
        time.sleep(0.1)
    left = session_processes(sid)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the run outlived the launcher by {within_s}s: {left}"


def wait_for(predicate, proc, what: str, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < end, f"no {what} within {timeout}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    summary = run(run_dir, "train.save_every=5", "train.keep_last=2")
    summary["dir"] = run_dir
    return summary


def test_retention_keeps_the_last_checkpoints_with_checksums(full):
    kept = [os.path.basename(d) for d in files.complete_steps(full["dir"])]
    # saved 4, 9, 14, 19 and, after the last step, 23; keep_last=2
    assert kept == ["step_0000019", "step_0000023"]
    assert sorted(os.listdir(full["dir"] / "checkpoints")) == kept  # no leftovers
    for step_dir in files.complete_steps(full["dir"]):
        assert files.verify(step_dir)["step"] == int(step_dir[-7:])
        assert all(os.path.exists(os.path.join(step_dir, p, files.MANIFEST))
                   for p in files.parts(step_dir))


@pytest.mark.timeout(600)
def test_term_then_kill_then_resume_loses_nothing(tmp_path, full, host_memory):
    """SIGTERM: the ranks stop together after a step, save it, the launcher says where, in
    one line, and nothing of the run is left. SIGKILL of the launcher alone: nothing is left
    either, and the next start (under torchrun) continues from the newest step's snapshot
    (``train.snapshot_dir``), not from the checkpoint six steps before; so does torchrun's
    restart after one of its workers is killed. Each resume into the same folder keeps the
    earlier metrics rows."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(ldt_train(run_dir, "train.save_every=100"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: (run_dir / "metrics.csv").exists() and len(metrics(run_dir)) >= 3,
                 proc, "three steps")
        os.kill(proc.pid, signal.SIGTERM)  # the launcher only
        _, err = proc.communicate(timeout=120)
    finally:
        assert_nothing_left(proc.pid)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    stop = int(re.search(r"stopped by SIGTERM after step (\d+); checkpoint (\S+) written", last)[1])
    assert files.latest(str(run_dir)) == files.step_dir(str(run_dir), stop)  # not a multiple of 100
    assert [s for s, _ in metrics(run_dir)] == list(range(stop + 1))

    shm = host_memory
    snapshots = f"train.snapshot_dir={shm}"
    proc = subprocess.Popen(ldt_train(run_dir, f"train.resume={run_dir}", "train.save_every=100",
                                      snapshots),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for(lambda: len(metrics(run_dir)) >= stop + 7, proc, "six more steps")
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: its ranks must not run on
        proc.wait(30)
    finally:
        assert_nothing_left(proc.pid)
    rows = metrics(run_dir)
    assert [s for s, _ in rows] == list(range(len(rows))) and len(rows) >= stop + 7
    assert len(rows) < STEPS, "the ranks ran on after their launcher was killed"
    assert files.latest(str(run_dir)) == files.step_dir(str(run_dir), stop)  # no newer one
    # on under torchrun (the same layout), from the snapshot; a worker killed: torchrun
    # re-forms the world, which goes on from the newest snapshot again
    killed_at = len(rows)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "--max-restarts", "1", "-m", "ldt.job.train", f"run_dir={run_dir}",
         f"train.steps={STEPS}", f"train.resume={run_dir}", snapshots],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        wait_for(lambda: _rows(run_dir) >= killed_at + 3, proc, "three steps under torchrun")
        os.kill(int((run_dir / "pids" / "rank_1").read_text()), signal.SIGKILL)  # a writer
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # its workers end with the agent (ldt.launch.lifetime)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    starts = [int(s) for s in re.findall(r"resuming from the snapshot of step (\d+)", out)]
    assert len(starts) == 2, out[-3000:]  # the first world, and torchrun's second
    assert stop + 4 <= starts[0] < killed_at and starts[0] < starts[1]  # not six steps back
    assert os.listdir(shm) == []  # a finished run leaves no snapshot in host memory
    rows = metrics(run_dir)  # every step once: earlier rows kept, later ones trained again
    assert [s for s, _ in rows] == list(range(STEPS))
    assert [loss for _, loss in rows] == pytest.approx(full["losses"], abs=1e-6)


@pytest.mark.timeout(400)
def test_resume_into_another_layout(tmp_path, full):
    step_dir = full["dir"] / "checkpoints" / "step_0000019"
    other = run(tmp_path / "b", "cluster=cpu_vtp", f"train.resume={step_dir}", own_process=True)
    assert other["first_step"] == 20
    assert other["losses"] == pytest.approx(full["losses"][20:], abs=1e-5)
    assert "Warning" not in other["stderr"], other["stderr"]  # #39: torch's, once per rank


@pytest.mark.timeout(400)
def test_disk_full_keeps_the_previous_checkpoint(tmp_path, full):
    """On a tmpfs with room for one checkpoint, the second save fails: the run says so in
    one line, no partial folder is left, and the first checkpoint resumes exactly."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
               os.walk(files.latest(str(full["dir"]))) for f in fs)
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs",
                              str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        run_dir = mnt / "run"
        proc = subprocess.run(ldt_train(run_dir, "train.save_every=2"), capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 1, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        failed = files.step_dir(str(run_dir), 3)
        assert last.startswith(f"ldt: disk full at {failed} ") and "Traceback" not in proc.stderr
        first = files.step_dir(str(run_dir), 1)
        assert files.complete_steps(str(run_dir)) == [first] and files.verify(first)
        assert not os.path.exists(failed)
        assert not [d for d, _, _ in os.walk(run_dir) if d.endswith(".tmp")]
        assert [s for s, _ in metrics(run_dir)] == [0, 1, 2, 3]  # the rows up to the failure
        resumed = run(tmp_path / "resumed", f"train.resume={first}")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    assert resumed["first_step"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], abs=1e-6)


def _damage(step_dir, how: str) -> str:
    """Damage one file of a copied checkpoint; returns its path."""
    part = os.path.join(step_dir, "stage_1")
    name = ".metadata" if how == "metadata" else "__0_0.distcp"
    path = os.path.join(part, name)
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        for i in range(100, 100 + 586):  # the bytes flipped in the report that found this
            data[i % len(data)] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.timeout(300)
def test_a_bad_checkpoint_is_refused_before_training(tmp_path, full):
    import yaml

    model = yaml.safe_load((full["dir"] / "config.yaml").read_text())["model"]
    source = files.latest(str(full["dir"]))
    cases = {}
    for how in ("flip", "truncate", "metadata"):
        step_dir = tmp_path / how / "checkpoints" / "step_0000023"
        shutil.copytree(source, step_dir)
        cases[how] = (step_dir, _damage(step_dir, how))
    from ldt.config import ConfigError, to_model
    from ldt.models.tensor_files import check_compatible

    for how, (step_dir, damaged) in cases.items():
        with pytest.raises(files.CheckpointError, match=re.escape(damaged)):
            files.preflight(str(step_dir.parent.parent), steps=STEPS + 10)
        if how == "truncate":  # flipped bytes keep the size: only the sha256 finds them
            with pytest.raises(files.CheckpointError, match=re.escape(damaged)):
                files.preflight(str(step_dir.parent.parent), steps=STEPS + 10, hashes=False)
    with pytest.raises(ConfigError, match=r"model\.hidden_size=64 but this run has "
                                          r"model\.hidden_size=128"):
        check_compatible(source, to_model({**model, "hidden_size": 128}))
    with pytest.raises(files.CheckpointError, match=r"end of its run .* raise train\.steps"):
        files.preflight(str(full["dir"]), steps=STEPS)
    files.preflight(str(full["dir"]), steps=STEPS + 10)  # the intact one is fine
    check_compatible(source, to_model(model))
    model_json = os.path.join(source, "model.json")  # written by the save, under the checksums
    assert files.read_info(source)["files"]["model.json"]["bytes"] == os.path.getsize(model_json)
    assert files.read_info(source)["optimizer"] == "adam"  # a resume with another is refused

    # the launcher refuses them before starting any rank: exit 2, one line
    for resume, extra, named in ((cases["flip"][0], ["train.steps=40"], cases["flip"][1]),
                                 (full["dir"], [], "train.steps=24"),
                                 (full["dir"], ["train.steps=40", "model.hidden_size=128"],
                                  "model.hidden_size=64")):
        t0 = time.monotonic()
        proc = subprocess.run([*ldt_train(tmp_path / "refused", f"train.resume={resume}"),
                               *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0], lines
        assert not (tmp_path / "refused" / "pids").exists()  # no rank started
        assert time.monotonic() - t0 < 30


def test_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "checkpoints" / "step_0000001" / "stage_0").mkdir(parents=True)
    assert files.latest(str(tmp_path)) is None  # no COMPLETE marker: never loaded
    with pytest.raises(files.CheckpointError, match="no complete checkpoint"):
        files.preflight(str(tmp_path), steps=10)


@pytest.mark.timeout(300)
def test_a_resumed_run_sends_the_noise_the_uninterrupted_one_sent(tmp_path):
    """train.boundary_noise: the noise of every step's sends (and of its evaluation) is drawn
    from a stream of that pass's own, so a run resumed from its checkpoint trains on the
    noise the uninterrupted run trained on, and their losses are equal."""
    noise = ("train.boundary_noise=0.5", "train.eval_every=1")
    through = run(tmp_path / "a", *noise, "train.save_every=2", steps=4)
    step_dir = tmp_path / "a" / "checkpoints" / "step_0000001"
    resumed = run(tmp_path / "b", *noise, f"train.resume={step_dir}", steps=4)
    assert resumed["first_step"] == 2
    assert resumed["losses"] == pytest.approx(through["losses"][2:], abs=1e-6)


# qwen3_moe_tiny with its cloud stage's experts spread over its two TP ranks (ep 2: four
# whole experts of eight on each), then cpu_vtp (TP 2/1/2, ep 1: each expert split)
EXPERT_PARALLEL = ("model=qwen3_moe_tiny", "cluster.stages.1.ep=2")


@pytest.mark.timeout(500)
def test_a_killed_run_continues_from_its_snapshot_in_another_layout(tmp_path, host_memory):
    """Killed with no checkpoint but its snapshots (train.save_every=100), the run started
    again in another layout (cluster=cpu_vtp: other TP sizes, another rank map, the experts
    no longer spread) cannot load its ranks' own parts: it joins the old layout's parts into a
    checkpoint of the run folder (attention's TP shards side by side, each expert from the
    rank that held it) and continues from the newest step it could join, not from step 0,
    with the losses of the uninterrupted run."""
    full = run(tmp_path / "full", *EXPERT_PARALLEL, "train.save_every=100")
    run_dir, shm = tmp_path / "run", host_memory
    snapshots = f"train.snapshot_dir={shm}"
    proc = subprocess.Popen(ldt_train(run_dir, *EXPERT_PARALLEL, "train.save_every=100",
                                      snapshots),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for(lambda: _rows(run_dir) >= 6, proc, "six steps")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        assert_nothing_left(proc.pid)
    killed_at = len(metrics(run_dir))
    assert files.latest(str(run_dir)) is None  # nothing on disk but the snapshots
    other = run(run_dir, "model=qwen3_moe_tiny", "cluster=cpu_vtp", "train.resume=auto",
                "train.save_every=100", snapshots, own_process=True)
    joined = re.search(r"resuming from the snapshot of step (\d+) in host memory, joined from "
                       r"layout \w+ into (\S+)", other["stdout"])
    assert joined, other["stdout"][-3000:]
    step = int(joined[1])
    assert killed_at - 3 <= step < killed_at and other["first_step"] == step + 1
    assert files.latest(str(run_dir)) is None or int(files.read_info(
        files.latest(str(run_dir)))["step"]) >= step  # the joined checkpoint (pruned or kept)
    rows = metrics(run_dir)
    assert [s for s, _ in rows] == list(range(STEPS))
    assert [loss for _, loss in rows] == pytest.approx(full["losses"], abs=1e-5)
