"""ldt-train across hosts: 3 network namespaces (ldt.testing.hosts), one stage per host.

cpu_demo (edge TP 1 | cloud0 TP 2 | cloud1 TP 1) runs with ranks [1, 2, 1] on hosts 0, 1, 2,
each rank started as torchrun would start it (rendezvous on host 0's address, gloo over each
host's eth0), with the prefetching U-shape schedule and an emulated edge <-> cloud delay, so
the real transport, the delay emulation and the schedule all cross a real (virtual) network.
One set of namespaces serves the module; the runs are cached so each is paid once:

* undisturbed: parity with the single-process reference, and traffic really left the edge;
* the edge's link cut mid-run: every process on every host exits non-zero within
  comm_timeout_s + 15 s with one line (no traceback), the edge's naming the boundary and
  stages; the last complete checkpoint resumes to exactly the undisturbed losses;
* the edge's link down for 2 s: the run finishes with exactly the undisturbed losses.

Skipped (with hosts.unavailable()'s reason) only where a namespace with a veth pair and a tbf
qdisc cannot be created: not root, no iproute2, `ip netns` refused.
"""

from __future__ import annotations

import csv
import glob
import os
import re
import subprocess
import sys
import time

import pytest

from ldt.storage.checkpoint_files import step_dir
from ldt.testing import hosts

pytestmark = pytest.mark.skipif(hosts.unavailable() is not None,
                                reason=f"no network namespaces: {hosts.unavailable()}")

RANKS = [1, 2, 1]  # cpu_demo: one stage per host
STEPS, SAVE_EVERY = 6, 3
PARITY = 1e-5
# warmup spans the steps before the first checkpoint: the cut run (train.steps=1000) trains
# them as the 6-step runs do (after warmup the cosine decay depends on train.steps)
OVERRIDES = ["cluster=cpu_demo", "train.prefetch=1", "cluster.link_delay_ms=[2,0,2]",
             "train.num_microbatches=4", f"train.save_every={SAVE_EVERY}",
             f"train.warmup_steps={SAVE_EVERY}"]


def _train(net, run_dir, *extra, comm_timeout=10):
    argv = [sys.executable, "-m", "ldt.job.train", f"run_dir={run_dir}", *OVERRIDES,
            f"train.comm_timeout_s={comm_timeout}", *extra]
    return net.start(argv, RANKS)


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def _wait_for_checkpoint(job, run_dir, timeout=90.0) -> None:
    end = time.monotonic() + timeout
    while not glob.glob(os.path.join(run_dir, "checkpoints", "*", "COMPLETE")):
        assert not job.poll(), "the run ended before its first checkpoint"
        assert time.monotonic() < end, "no checkpoint within the time limit"
        time.sleep(0.05)


def _tx_bytes(net, host: int) -> int:
    out = subprocess.run(["ip", "-n", net.namespace(host), "-s", "link", "show", hosts.IFNAME],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    tx = next(i for i, line in enumerate(out) if line.strip().startswith("TX:"))
    return int(out[tx + 1].split()[0])


@pytest.fixture(scope="module")
def net():
    with hosts.Hosts(3) as h:
        yield h
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert h.name not in left, f"namespaces left behind: {left}"


@pytest.fixture(scope="module")
def undisturbed(net, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("undisturbed"))
    before = _tx_bytes(net, 0)
    results = _train(net, run_dir, f"train.steps={STEPS}").wait(240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    return run_dir, _tx_bytes(net, 0) - before, results


@pytest.mark.timeout(300)
def test_three_hosts_match_the_single_process_reference(undisturbed, tmp_path):
    from omegaconf import OmegaConf

    from ldt.job.prepare import reference_config
    from ldt.launch.local import run_local_world
    from ldt.training.loop import train_worker

    run_dir, edge_tx, results = undisturbed
    # the config the 3-host run trained with (its rank 0 saved it), as ldt-train --verify uses
    cfg = OmegaConf.to_container(OmegaConf.load(os.path.join(run_dir, "config.yaml")))
    ref = run_local_world(1, train_worker, (reference_config(cfg), str(tmp_path)),
                          timeout_s=240)[0]
    got = _losses(run_dir)
    assert sorted(got) == list(range(STEPS))
    assert max(abs(got[s] - ref["losses"][s]) for s in got) < PARITY, (got, ref["losses"])
    # the edge's activations (FS -> cloud0) and gradients (BS -> cloud1) left through its eth0:
    # 4 micro-batches x 2 tensors of 64 x 2 x 64 fp32 per step
    assert edge_tx > STEPS * 4 * 2 * 64 * 2 * 64 * 4
    assert '"final_loss"' in results[0].stdout.splitlines()[-1]  # the edge reports the loss


@pytest.mark.timeout(300)
def test_cut_link_stops_every_host_and_the_checkpoint_resumes_exactly(net, undisturbed,
                                                                      tmp_path):
    comm_timeout = 5
    run_dir = str(tmp_path / "cut")
    job = _train(net, run_dir, "train.steps=1000", comm_timeout=comm_timeout)
    _wait_for_checkpoint(job, run_dir)
    cut_at = time.monotonic()
    net.set_link(0, up=False)  # the edge is cut off from both cloud hosts
    try:
        results = job.wait(comm_timeout + 60)
    finally:
        net.set_link(0, up=True)
    for r in results:
        assert r.returncode not in (0, None), f"rank {r.rank} on host {r.host}: {r.returncode}"
        assert r.exited_at - cut_at < comm_timeout + 15, (r.rank, r.exited_at - cut_at)
    # every rank says in one line who it is and why it stopped, no traceback (as a bare
    # launch names the rank that failed first); the edge's leader names a boundary to a cloud
    # stage, the stages, the peer and the seconds
    for r in results:  # (torch's C++ warnings, "[W1125 11:08:26.297 socket.cpp:207] ...", aside)
        lines = [x for x in r.stderr.splitlines() if x and not re.match(r"\[W\d{4} ", x)]
        assert len(lines) == 1 and lines[0].startswith(f"ldt: rank {r.rank} (stage "), r.stderr
    assert re.search(r"^ldt: rank 0 \(stage 0 'edge', TP rank 0\) failed \(step \d+, .*\): "
                     r"boundary (0->1|2->0): rank 0 \(stage 0 'edge'\) (receive of|send of) an? "
                     r"(activation|gradient) (from|to) stage (1 'cloud0'|2 'cloud1') \(rank \d\) "
                     r"failed \d+\.\d s after", results[0].stderr, re.M), results[0].stderr
    # resume from the checkpoint of the warmup's end (a cut that came late on a loaded machine
    # leaves a later one, of the 1000-step schedule): the undisturbed losses from there on
    resumed, first = str(tmp_path / "resumed"), step_dir(run_dir, SAVE_EVERY - 1)
    results = _train(net, resumed, f"train.steps={STEPS}", f"train.resume={first}").wait(240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    want, got = _losses(undisturbed[0]), _losses(resumed)
    assert got and min(got) >= SAVE_EVERY and max(got) == STEPS - 1
    assert got == {s: want[s] for s in got}


@pytest.mark.timeout(300)
def test_link_down_for_two_seconds_changes_nothing(net, undisturbed, tmp_path):
    run_dir = str(tmp_path / "blip")
    job = _train(net, run_dir, f"train.steps={STEPS}")
    _wait_for_checkpoint(job, run_dir)  # mid-run: steps are still to come
    down = time.monotonic()
    net.set_link(0, up=False)
    time.sleep(2.0)
    net.set_link(0, up=True)
    up = time.monotonic()
    results = job.wait(240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    # the run was training across the cut: the edge started steps before it and after it
    # (action_times.csv's step starts are on this machine's monotonic clock)
    from ldt.plan.calibrate import read_action_times

    starts = {r.step: r.step_start_s for r in read_action_times(run_dir) if r.action.stage == 0}
    assert min(starts.values()) < down and max(starts.values()) > up, (down, up, starts)
    assert _losses(run_dir) == _losses(undisturbed[0])


def test_harness_limits_bandwidth_and_removes_only_its_leftovers():
    """tbf holds a host's link to its rate; a dead harness's namespace is removed at start,
    a namespace with another name is not touched."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover, foreign = f"{hosts.PREFIX}-{dead.pid}-0-h0", f"ldtother-{os.getpid()}"
    for ns in (leftover, foreign):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        with hosts.Hosts(2, rate_mbit=[40, None]) as net:
            names = subprocess.run(["ip", "netns", "list"], capture_output=True,
                                   text=True).stdout
            assert leftover not in names and foreign in names
            server = net.popen(1, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE)
            assert server.stdout.readline() == b"listening\n"  # no connection refused
            client = net.popen(0, [sys.executable, "-c", _SOURCE, net.address(1), "4"],
                               stdout=subprocess.PIPE)
            seconds = float(client.communicate(timeout=60)[0])
            server.communicate(timeout=10)
        mbit = 4 * 2**20 * 8 / seconds / 1e6
        assert 25 < mbit < 42, mbit  # a loaded machine's stall only lowers it
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=False)
        subprocess.run(["ip", "netns", "del", leftover], check=False, capture_output=True)


_SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1); print("listening", flush=True); c, _ = s.accept()
while c.recv(1 << 20): pass
c.close()
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5001)); buf = b"x" * (1 << 20)
t = time.perf_counter()
for _ in range(int(sys.argv[2])): c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.perf_counter() - t)
"""
