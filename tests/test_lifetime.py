"""A worker never outlives the process that started it: torchrun's agent, killed with
SIGKILL (its workers are in sessions of their own, so nothing else reaches them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

ONE_RANK = ["cluster.stages=[{name:a,device:cpu,tp:1}]", "cluster.u_shape=false",
            "cluster.layout=null"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, seconds: float, step: float = 0.1) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(120)
def test_a_torchrun_worker_ends_with_its_agent(tmp_path):
    """ldt-train's worker under torchrun, its agent SIGKILLed while the worker starts a
    run of 100000 steps: the worker is gone within seconds (without ldt's tie it trains on,
    here alone, for as long as the run lasts)."""
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         "-m", "ldt.job.train", f"run_dir={tmp_path / 'run'}", "train.steps=100000", *ONE_RANK],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    workers: list[psutil.Process] = []
    try:
        # the worker has passed ldt-train's start (where it ties itself to the agent) once it
        # says what starts
        assert _wait_for(lambda: "joining torchrun's world" in (tmp_path / "agent.log")
                         .read_text(), 90), (tmp_path / "agent.log").read_text()[-3000:]
        workers = psutil.Process(agent.pid).children()
        assert len(workers) == 1 and workers[0].pid != agent.pid
        assert os.getsid(workers[0].pid) == workers[0].pid  # a session of its own
        agent.kill()
        agent.wait(10)
        assert _wait_for(lambda: _gone(workers[0].pid), 20), \
            f"worker {workers[0].pid} still runs 20 s after its agent was killed"
    finally:
        for w in workers:  # the worker's own session: killing the agent does not reach it
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        log.close()


def test_only_torchrun_workers_are_tied(monkeypatch):
    """Bare (or another launcher's RANK): nothing is armed."""
    from ldt.launch import lifetime

    monkeypatch.delenv(lifetime.TORCHRUN_WORKER, raising=False)
    armed = []
    monkeypatch.setattr(lifetime, "die_with_parent", lambda: armed.append(1) or True)
    assert lifetime.stop_with_torchrun_agent() is False and armed == []
    monkeypatch.setenv(lifetime.TORCHRUN_WORKER, "run")
    assert lifetime.stop_with_torchrun_agent() is True and armed == [1]
