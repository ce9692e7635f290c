"""How a local world starts its ranks (ldt.launch.local.start_method).

On a machine with an accelerator every rank is spawned, a fresh interpreter: CUDA refuses to
start in a rank forked from ldt's forkserver once the forkserver's imports have asked the
driver anything (every CUDA rank of the first GPU run failed so). The CPU machine forks from
the forkserver as before. Here a spawned world runs for real over gloo, on the CPU.
"""

import os
import sys

import pytest
import torch

from ldt.launch import local
from ldt.launch.local import WorldError, run_local_world, start_method


def _sum_and_origin(rank: int, world: int) -> dict:
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "parent": os.getppid(),
            "preloaded": "megatron.core.parallel_state" in sys.modules}


def _fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.timeout(120)
def test_a_spawned_world_runs_over_gloo_and_its_failures_name_the_rank():
    out = run_local_world(2, _sum_and_origin, timeout_s=60, start="spawn")
    assert [r["sum"] for r in out] == [3.0, 3.0]
    # a spawned rank is the launcher's own child and has imported nothing it did not need;
    # a forked one is the forkserver's child, with megatron-core already imported
    assert all(r["parent"] == os.getpid() and not r["preloaded"] for r in out)
    forked = run_local_world(2, _sum_and_origin, timeout_s=60, start="forkserver")
    assert all(r["parent"] != os.getpid() and r["preloaded"] for r in forked)
    with pytest.raises(WorldError, match="rank 1 broke on purpose") as err:
        run_local_world(2, _fails_on_rank_1, timeout_s=60, comm_timeout_s=10, start="spawn")
    assert err.value.rank == 1


def _outlasts_its_comm_timeout(rank: int, world: int) -> float:
    import time

    import torch.distributed as dist

    time.sleep(3.0)  # longer than the groups' 1 s: only a collective may wait that long
    dist.barrier()
    return 3.0


@pytest.mark.timeout(120)
def test_a_world_without_a_time_limit_runs_as_long_as_it_works(monkeypatch):
    """ldt-train and ldt-megatron give their world no wall-clock limit (a healthy run of slow
    steps ran into one: max(600 s, 30 s per step), 20 minutes for a Megatron script): a hang
    is what the groups' comm_timeout_s ends, and a rank busy past it is no hang."""
    out = run_local_world(2, _outlasts_its_comm_timeout, timeout_s=None, comm_timeout_s=1.0)
    assert out == [3.0, 3.0]
    import ldt.job.megatron
    import ldt.job.train

    seen = []

    def recorded(world_size, fn, args=(), **kwargs):
        seen.append(kwargs["timeout_s"])
        raise WorldError("stop here", None)

    for module in (ldt.job.train, ldt.job.megatron):
        monkeypatch.setattr(module, "run_local_world", recorded, raising=False)
    monkeypatch.setattr(local, "run_local_world", recorded)
    ldt.job.megatron.main(["--cluster", os.path.join(os.path.dirname(__file__), "..", "conf",
                                                     "cluster", "cpu_demo.yaml"), "script.py"])
    assert seen == [None]


def test_a_machine_with_an_accelerator_spawns_its_ranks(monkeypatch):
    monkeypatch.delenv("LDT_START_METHOD", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert start_method() == "spawn"
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert start_method() == "forkserver"
    monkeypatch.setenv("LDT_START_METHOD", "spawn")
    assert start_method() == "spawn"
    monkeypatch.setenv("LDT_START_METHOD", "fork")
    with pytest.raises(ValueError, match="LDT_START_METHOD='fork': use 'forkserver' or 'spawn'"):
        start_method()
    assert local._context("spawn").get_start_method() == "spawn"
    assert local._context("forkserver").get_start_method() == "forkserver"


def test_a_stop_signal_while_the_world_starts_reaches_the_ranks_started_after_it(monkeypatch):
    """A SIGTERM before a rank has a pid went to nobody: that rank trained on until the stop
    grace ran out, then was killed without a checkpoint. Each rank gets it once."""
    import signal
    from types import SimpleNamespace

    sent = []
    monkeypatch.setattr(local.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    ranks = [SimpleNamespace(pid=11), SimpleNamespace(pid=None)]
    stop = local._StopSignals(ranks, grace_s=5.0)
    stop._on_signal(signal.SIGTERM, None)
    assert sent == [(11, signal.SIGTERM)]
    ranks[1].pid = 12  # started after the signal
    stop.forward()
    stop.forward()
    assert sent == [(11, signal.SIGTERM), (12, signal.SIGTERM)]
