"""Failure behaviour: a dead rank stops the whole run fast, names itself, leaves no process.

`ldt-train` is started bare (it launches its own world), and once under torchrun; once steps
run, one rank is SIGKILLed. Every process must be gone within comm_timeout_s + 15 s, the
launcher must exit non-zero and name the rank and stage that failed first (under torchrun:
each rank left names itself in one line, torchrun's summary names the rank that died).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ldt.launch.local import WorldError, run_local_world

COMM_TIMEOUT = 10
HANG_TIMEOUT = 5  # a stopped rank is found only by the timeout: the test waits for it


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


def _kill_while_training(argv, run_dir, victim: int):
    """Start ``argv`` (4 ranks writing ``run_dir``), SIGKILL rank ``victim`` once steps run;
    return (exit status, stderr, seconds from the kill to the launcher's exit). Every rank
    must be gone within 5 s of that exit."""
    proc = subprocess.Popen([*argv, f"run_dir={run_dir}", "train.steps=100000",
                             f"train.comm_timeout_s={COMM_TIMEOUT}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids = []
    try:
        metrics = run_dir / "metrics.csv"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no training steps"
            time.sleep(0.05)
        pids = [int((run_dir / "pids" / f"rank_{r}").read_text()) for r in range(4)]
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        _, err = proc.communicate(timeout=COMM_TIMEOUT + 15)
        elapsed = time.monotonic() - killed_at
        end = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived the launcher"
        return proc.returncode, err, elapsed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,where", [
    (0, "stage 0 'edge', TP rank 0"),     # stage 0, the edge's leader
    (2, "stage 1 'cloud0', TP rank 1"),   # a non-leader
], ids=["edge_leader", "non_leader"])  # a middle stage's leader: the torchrun test below
def test_killed_rank_stops_everything(tmp_path, victim, where):
    code, err, elapsed = _kill_while_training([sys.executable, "-m", "ldt.job.train"], tmp_path,
                                              victim)
    assert code != 0
    assert f"rank {victim} ({where}) failed first" in err, err[-2000:]
    assert "killed by SIGKILL" in err
    assert elapsed < COMM_TIMEOUT + 15


@pytest.mark.timeout(240)
def test_a_rank_lost_under_torchrun_reads_like_the_bare_launcher(tmp_path):
    """Rank 1 (cloud0's leader) is SIGKILLed, bare and under torchrun; both end within
    comm_timeout_s + 15 s, leave no process and print no traceback. Bare: one line naming the
    rank that failed first. Under torchrun no launcher of ldt's sees the whole world: each
    rank left says in one line who it is, where it was and why it stopped, and ends with its
    own exit status; torchrun's summary shows rank 1's SIGKILL and the others' lines."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, bare, elapsed = _kill_while_training([sys.executable, "-m", "ldt.job.train"],
                                               tmp_path / "bare", 1)
    assert code != 0 and elapsed < COMM_TIMEOUT + 15
    assert bare.strip().splitlines() == [
        "ldt: training failed: rank 1 (stage 1 'cloud0', TP rank 0) failed first: rank 1 "
        "exited with code -9 (killed by SIGKILL) before reporting"], bare[-3000:]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "ldt.job.train"]
    code, err, elapsed = _kill_while_training(torchrun, tmp_path / "torchrun", 1)
    assert code != 0 and elapsed < COMM_TIMEOUT + 15
    assert "Error executing job" not in err and "HYDRA" not in err
    # before torchrun's report ("E... failed (exitcode: -9) local_rank: 1 ...", its traceback
    # and summary): torchrun's log lines and the ranks' own lines, no traceback
    torchrun_log = re.compile(r"[IWE]\d{4} [\d:.]+ \d+ \S*torch/distributed/")
    parts = re.split(r"\n[IWE]\d{4} [^\n]* failed \(exitcode", err, maxsplit=1)
    assert len(parts) == 2, f"no 'failed (exitcode' report of torchrun's:\n{err[-4000:]}"
    ranks_part, summary = parts
    assert "Traceback" not in ranks_part, ranks_part[-3000:]
    lines = [x for x in ranks_part.splitlines() if x and not torchrun_log.match(x)]
    assert len(lines) == 3, ranks_part  # one line per rank left (bare: one line in all)
    for label in ("rank 0 (stage 0 'edge', TP rank 0)", "rank 2 (stage 1 'cloud0', TP rank 1)",
                  "rank 3 (stage 2 'cloud1', TP rank 0)"):
        mine = [x for x in lines if x.startswith(f"ldt: {label} failed (step ")]
        assert len(mine) == 1, (label, lines)
        assert re.search(r"\): (boundary \d->\d: rank \d .*failed [\d.]+ s after|lost a peer)",
                         mine[0]), mine[0]
        assert f"traceback : {mine[0]}" in summary  # torchrun's summary shows it (error file)
        # it ended by its own report, not by torchrun's SIGTERM (which arrives while the rank
        # fails too: were it not held, the rank could die before it says why)
        number = label.split()[1]
        assert re.search(rf"rank      : {number} \(local_rank: {number}\)\n  exitcode  : 1 ",
                         summary), summary
    # rank 1 said nothing: torchrun's summary has its SIGKILL (as its root cause, unless a
    # rank left wrote its line in an earlier second: torchrun dates failures to the second)
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : -9 .*\(SIGKILL\)",
                     summary), summary


class CorruptSecondActivation:
    """A boundary observer on the sender that turns micro-batch 1's activation into NaN."""

    def __init__(self):
        self.sent = 0

    def on_send(self, src, dst, direction, tensor):
        if src == 0 and direction == "F":
            if self.sent == 1:
                tensor.view(-1)[0] = float("nan")
            self.sent += 1

    def on_recv(self, *args):
        pass


def _nan_at_boundary(rank, world):
    from types import SimpleNamespace

    from megatron.core import tensor_parallel

    import ldt
    from gpt_worlds import MBS, MODEL, forward_step, make_batches
    from ldt import patches
    from ldt.config import ClusterConfig, StageConfig
    from ldt.models.init import init_chunk
    from ldt.models.build import build_chunk, global_param_name
    from ldt.training.observe import FiniteCheck
    from ldt.topology.ranks import Topology

    topo = Topology.from_config(ClusterConfig(stages=[StageConfig("edge", "cpu", 1),
                                                      StageConfig("cloud", "cpu", 2)]), MODEL)
    state = ldt.initialize_vtp(topo, timeout_s=30)
    check = FiniteCheck()
    check.new_step(0)
    from ldt.pipeline.forward_backward import MegatronHooks
    patches.apply(["cpu_shims", "schedules"],
                  ctx=MegatronHooks((CorruptSecondActivation(), check)))
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    chunk = topo.split.stage_chunks(state.stage)[0]
    tp = topo.stages[state.stage].tp
    gpt = build_chunk(MODEL, chunk, tp)
    init_chunk(gpt, seed=1, num_layers=MODEL.num_layers, tp=tp, tp_rank=state.info.tp_rank,
               rename=lambda n: global_param_name(chunk, n))
    from megatron.core.pipeline_parallel import get_forward_backward_func  # after the patch

    get_forward_backward_func()(forward_step_func=forward_step,
                                data_iterator=iter(make_batches(3)), model=gpt,
                                num_microbatches=3, seq_length=MODEL.seq_length,
                                micro_batch_size=MBS)


@pytest.mark.timeout(120)
def test_nan_at_a_boundary_is_reported():
    with pytest.raises(WorldError) as err:
        run_local_world(3, _nan_at_boundary, timeout_s=90, comm_timeout_s=20)
    text = str(err.value)
    assert "non-finite activation received by stage 1 from stage 0" in text, text[-3000:]
    assert "micro-batch 1" in text


@pytest.mark.timeout(120)
def test_a_hang_names_the_rank_everyone_waits_for(tmp_path):
    """Rank 2 (a non-leader of the middle stage) is stopped with SIGSTOP: its peers time out,
    and the report names rank 2, not the first rank that timed out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ldt.job.train", f"run_dir={tmp_path}", "train.steps=100000",
         f"train.comm_timeout_s={HANG_TIMEOUT}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = []
    try:
        metrics = tmp_path / "metrics.csv"
        deadline = time.monotonic() + 60
        while not (metrics.exists() and len(metrics.read_text().splitlines()) > 3):
            assert proc.poll() is None and time.monotonic() < deadline, "no training steps"
            time.sleep(0.05)
        pids = [int((tmp_path / "pids" / f"rank_{r}").read_text()) for r in range(4)]
        os.kill(pids[2], signal.SIGSTOP)
        _, err = proc.communicate(timeout=HANG_TIMEOUT + 30)
        assert proc.returncode == 1
        assert "rank 2 (stage 1 'cloud0', TP rank 1) stopped making progress: its process " \
               "is stopped" in err, err[-3000:]
        end = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived the launcher"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_blame_names_who_the_others_wait_for():
    from ldt.launch.progress import RankProgress, blame

    def rank(r, *, state="S", step=5, label="1F3", waiting=True, for_s=10.0, beat=0.2):
        return RankProgress(rank=r, alive=True, os_state=state, step=step, label=label,
                            waiting=waiting, for_s=for_s, heartbeat_age_s=beat, done=False)

    waits = [rank(0), rank(1, waiting=False), rank(3)]  # rank 1: blocked inside a TP collective
    assert blame([*waits, rank(2, state="T")])[0] == 2  # stopped
    assert blame([*waits, rank(2, beat=12.0)])[0] == 2  # frozen: no heartbeat
    assert blame([rank(0), rank(1, waiting=False, for_s=30.0), rank(2)])[0] == 1  # busy
    assert blame([rank(0), rank(1, step=4), rank(2)])[0] == 1  # behind everyone
    assert blame([rank(0), rank(1), rank(2)]) is None  # nothing tells them apart


def _stop_together(rank, world, launcher_pid, signum):
    """Steps until the ranks agree to stop; rank 1 signals the launcher at its step 3, and
    says at its step 2 that its snapshot writer is still busy (every rank must skip that
    step's snapshot: ldt.training.snapshot)."""
    from types import SimpleNamespace

    from ldt.training.guard import StepGuard, StopSignals

    state = SimpleNamespace(topology=SimpleNamespace(num_stages=1), stage=0)
    skipped = []  # the steps whose snapshot every rank skips
    with StopSignals() as signals:
        guard = StepGuard(state, signals)
        for step in range(10_000):
            time.sleep(0.02 * (rank + 1))  # the ranks see the forwarded signal at other times
            if rank == 1 and step == 3:
                os.kill(launcher_pid, signum)
            decision = guard.agree(loss=1.0, grad_norm=1.0, peak_gib=0.1 * (rank + 1),
                                   snapshot_busy=rank == 1 and step == 2)
            if decision.snapshot_busy:
                skipped.append(step)
            if decision.signum:
                return step, decision.signum, decision.peak_memory_gib, skipped
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGHUP])  # SIGTERM: test_checkpoint
def test_a_signal_to_the_launcher_stops_every_rank_after_the_same_step(sent):
    out = run_local_world(2, _stop_together, (os.getpid(), sent), timeout_s=90,
                          comm_timeout_s=30)
    assert out[0] == out[1], out
    step, signum, peaks, skipped = out[0]
    assert step >= 3 and signum == sent and peaks == pytest.approx([0.2]) and skipped == [2]


@pytest.mark.timeout(120)
def test_a_nonfinite_loss_stops_the_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ldt.job.train", f"run_dir={tmp_path}",
                           "train.steps=20", "train.lr=1e30"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "training stopped at step 1: non-finite loss (nan) on stage 0 'edge'" in last, last
    assert "train.stop_on_nonfinite=false" in last
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[2].startswith("1,nan,")  # header, step 0, step 1


def test_the_summary_is_always_valid_json():
    import json

    from ldt.training.outputs import summary_json

    line = summary_json({"final_loss": float("nan"), "losses": [1.0, float("inf")], "steps": 2})
    assert json.loads(line) == {"final_loss": None, "losses": [1.0, None], "steps": 2}


def _raised(exc, cause=None):
    """``exc`` as raised (``from cause``), with its traceback."""
    try:
        if cause is None:
            raise exc
        try:
            raise cause
        except BaseException as inner:
            raise exc from inner
    except BaseException as caught:
        return caught


def test_a_rank_failure_is_one_line_and_torchruns_summary_shows_it(tmp_path, monkeypatch,
                                                                  capsys):
    """What a rank under torchrun prints (ldt.training.failure): ldt's reason in one line, a
    lost peer or a refused config too; a bug gets the line and its traceback, once. The line
    goes to torchrun's error file, which torchrun's own reader puts in its summary."""
    from torch.distributed.elastic.multiprocessing.errors import (ChildFailedError,
                                                                  ProcessFailure)

    from ldt.boundary.work import BoundaryError
    from ldt.config import ConfigError
    from ldt.pipeline.runtime import ActionError
    from ldt.training.failure import reason, report

    cut = ("boundary 2->0: rank 0 (stage 0 'edge') receive of an activation from stage 2 "
           "'cloud1' (rank 3) failed 20.0 s after it was posted (RuntimeError: [unbound_buffer"
           ".cc:78] Timed out waiting 20000ms for recv operation to complete)")
    wrapped = _raised(ActionError("stage 0 failed at action #5 0WAIT_F1 (BoundaryError: ...)\n"
                                  "<the stage's action grid>"), BoundaryError(cut))
    assert reason(wrapped) == (cut, 1)
    gone = _raised(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:6315. This "
                                "is typically caused by a remote worker crashing."))
    lost = ("lost a peer (a rank died or stalled, or a link is down): RuntimeError: [pair.cc:"
            "553] Connection closed by peer [127.0.0.1]:6315. This is typically caused by a "
            "remote worker crashing.")
    assert reason(gone) == (lost, 1)
    # a TP collective inside a compute action: the runtime's wrapper adds nothing to say
    assert reason(_raised(ActionError(f"stage 1 failed at action #12 1F2 ({gone!r})"),
                          gone)) == (lost, 1)
    assert reason(_raised(ConfigError("cluster.dp=3: ...; set cluster.dp=1"))) == (
        "invalid config: cluster.dp=3: ...; set cluster.dp=1", 2)
    assert reason(_raised(KeyError("stage"))) is None  # a bug in ldt
    assert reason(_raised(RuntimeError("shape mismatch"))) is None

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert report(wrapped, "rank 0 (stage 0 'edge', TP rank 0)") == 1
    line = f"ldt: rank 0 (stage 0 'edge', TP rank 0) failed: {cut}"
    assert capsys.readouterr().err == line + "\n"
    seen = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert f"traceback : {line}\n" in ChildFailedError("ldt.job.train", {0: seen}).format_msg()

    assert report(_raised(KeyError("stage")), "rank 2 (stage 1 'cloud0', TP rank 1)") == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("ldt: rank 2 (stage 1 'cloud0', TP rank 1) failed: an error in ldt "
                      "itself, please report it with the traceback below: KeyError: 'stage'")
    assert err[1] == "Traceback (most recent call last):" and err[-1] == "KeyError: 'stage'"
    assert sum(x.startswith("Traceback") for x in err) == 1
    assert err[0] in json.loads(error_file.read_text())["message"]["message"]

    class Writes(list):  # a node's ranks share torchrun's stderr: one line, one write
        def write(self, text):
            self.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Writes())
    report(wrapped, "rank 0 (stage 0 'edge', TP rank 0)")
    assert sys.stderr == [line + "\n"]


def test_a_refusal_under_torchrun_fills_its_error_file_and_the_first_cause_wins(
        tmp_path, monkeypatch, capsys):
    """In process, with the environment torchrun gives a worker: ldt-train's refusals before
    the world forms (ldt's config check, its command-line check, Hydra's own refusal) each
    print one line and write it to the error file torchrun's summary reads; a line written
    before (a training failure's, the first cause) stays."""
    from ldt.job.hydra import run_app
    from ldt.job.train import _job
    from ldt.launch.lifetime import say_stop, write_torchrun_error

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.chdir(tmp_path)

    def refused(args, rank: str, world: str, expect: str) -> None:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        error_file.unlink(missing_ok=True)
        assert run_app(_job, args) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("ldt: ")]
        assert len(lines) == 1 and expect in lines[0], lines
        assert json.loads(error_file.read_text())["message"]["message"] == lines[0]

    refused(["run_dir=out"], "0", "3", "world size is 3")  # the world the cluster needs
    refused(["train.stepz=3"], "1", "4", "train.stepz")  # before Hydra composes
    refused(["cluster=no_such_cluster"], "1", "4", "no_such_cluster")  # Hydra's refusal

    first = "ldt: rank 0 (stage 0 'edge', TP rank 0) failed: lost a peer"
    write_torchrun_error(first)
    say_stop("ldt: stopped by SIGTERM after step 3")
    assert capsys.readouterr().err == "ldt: stopped by SIGTERM after step 3\n"
    assert json.loads(error_file.read_text())["message"]["message"] == first


def test_a_handler_closing_the_held_stderr_leaves_the_real_one_open():
    """A logging handler made while Hydra composes holds ldt's stand-in for stderr (absl's,
    made on megatron-core's import from 0.17) and, when logging is configured again, closes
    the stream it holds (as absl's ``close()`` does): the real stderr stays open."""
    import io

    from ldt.job.hydra_guard import HeldStderr

    real = io.StringIO()
    held = HeldStderr(real)
    held.release()
    held.close()  # what the handler's close() does to the stream it holds
    held.write("still open\n")
    assert real.getvalue() == "still open\n" and not real.closed


def test_an_idle_process_that_lost_its_world_says_so_to_torchrun(tmp_path, monkeypatch,
                                                                  capsys):
    """An elastic world's idle process (no rank in the plan) whose store's host is gone
    exits 1 with one line, on stdout and in the error file torchrun's summary reads."""
    from ldt.elastic.world import ElasticWorld

    class GoneStore:
        def wait(self, keys, timeout):
            raise RuntimeError("Connection reset by peer\nC++ frames...")

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    world = ElasticWorld(rank=None, plan=None, run={}, store=GoneStore())
    assert world.wait_idle() == 1
    line = ("ldt: an idle process lost its world before the run ended (Connection reset by "
            "peer")
    assert capsys.readouterr().out == line + "\n"
    assert json.loads(error_file.read_text())["message"]["message"] == line


def test_the_step_agreement_group_of_an_accelerator_run_times_out_as_every_group(monkeypatch):
    """On an all-CUDA world (nccl default group) the step agreement runs on a gloo group of
    its own: with train.comm_timeout_s like every group ldt makes, not torch's default of
    30 minutes for a new group (a stalled rank would hold every other at each step)."""
    from datetime import timedelta

    import torch.distributed as dist

    from ldt.training.guard import StepGuard

    made = []
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "group")
    assert StepGuard.world_group(42.0) == "group"
    assert made == [{"backend": "gloo", "timeout": timedelta(seconds=42.0)}]


def _slow_writer(rank: int, world: int, group_kind: str):
    from ldt.training import checkpoint

    group = checkpoint.save_group() if group_kind == "save" else None
    if rank == 1:
        time.sleep(4.0)  # its part's write: longer than the groups' 2 s
    return checkpoint._all_errors(None, group)


@pytest.mark.timeout(120)
def test_a_save_slower_than_the_comm_timeout_is_waited_for():
    """A save's agreement waits for the slowest writer's disk on a group of its own
    (checkpoint.save_group), not with train.comm_timeout_s: on the default group a healthy
    slow save failed the run at its first checkpoint."""
    assert run_local_world(2, _slow_writer, ("save",), timeout_s=60,
                           comm_timeout_s=2.0) == [[], []]
    with pytest.raises(WorldError):
        run_local_world(2, _slow_writer, ("default",), timeout_s=60, comm_timeout_s=2.0)
