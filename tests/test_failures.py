"""Failure behaviour: a dead rank stops the whole run fast, names itself, leaves no process.

`ldt-train` is started bare (it launches its own world); once every rank has written its
pid, one rank is SIGKILLed. Every process must be gone within comm_timeout_s + 15 s, the
launcher must exit non-zero and name the rank and stage that failed first.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from ldt.launch import WorldError, run_local_world

COMM_TIMEOUT = 10


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,where", [
    (0, "stage 0 'edge', TP rank 0"),     # stage 0, the edge's leader
    (1, "stage 1 'cloud0', TP rank 0"),   # a middle stage's leader
    (2, "stage 1 'cloud0', TP rank 1"),   # a non-leader
], ids=["edge_leader", "middle_leader", "non_leader"])
def test_killed_rank_stops_everything(tmp_path, victim, where):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ldt.train", f"run_dir={tmp_path}", "train.steps=100000",
         f"train.comm_timeout_s={COMM_TIMEOUT}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid_files = [tmp_path / "pids" / f"rank_{r}" for r in range(4)]
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text().strip() for p in pid_files):
            assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in pid_files]
        time.sleep(2.0)  # let training run
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        _, err = proc.communicate(timeout=COMM_TIMEOUT + 15)
        elapsed = time.monotonic() - killed_at
        assert proc.returncode != 0
        assert f"rank {victim} ({where}) failed first" in err, err[-2000:]
        assert "killed by SIGKILL" in err
        end = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived the launcher"
        assert elapsed < COMM_TIMEOUT + 15
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


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
    from ldt.topology import Topology

    topo = Topology.from_config(ClusterConfig(stages=[StageConfig("edge", "cpu", 1),
                                                      StageConfig("cloud", "cpu", 2)]), MODEL)
    state = ldt.initialize_vtp(topo, timeout_s=30)
    check = FiniteCheck()
    check.new_step(0)
    patches.apply(["cpu_shims", "schedules"],
                  ctx=SimpleNamespace(observers=[CorruptSecondActivation(), check]))
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
