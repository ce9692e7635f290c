"""torchrun's elastic agent on namespace hosts (:mod:`ldt.testing.hosts`): one agent per host.

For the elastic tests and benchmark: each host runs ``torchrun --nnodes MIN:MAX --rdzv-backend
c10d --max-restarts N`` with its own ``--nproc-per-node`` and ``LDT_NODE_KIND``, the rendezvous
on host 0 (the data owner's edge, as docs/elastic.md recommends), exactly as on real machines;
a host can then be killed (every process in it), cut off, or started again.

The rendezvous settings shorten what waits on time: ``last_call_timeout`` (how long a round
waits for more nodes once MIN are there, 30 s by default) and the keep-alive that declares a
lost node dead (5 s x 3 by default). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: see
:func:`ldt.elastic.world.check_launcher`.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

from ldt.testing.hosts import Hosts

RDZV_PORT = 29400
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


class ElasticAgents:
    """One torchrun agent per host; ``nodes[i] = (LDT_NODE_KIND, --nproc-per-node)`` of host i.

    ``args``: what torchrun runs (e.g. ``["-m", "ldt.job.train", "cluster=cpu_elastic", ...]``).
    Every agent's output (its workers' included) goes to ``<workdir>/agent<i>.log``, appended
    across restarts of the host.
    """

    def __init__(self, net: Hosts, nodes: Sequence[tuple[str, int]], args: Sequence[str], *,
                 min_nodes: int, max_restarts: int = 3, run_id: str = "ldt",
                 port: int = RDZV_PORT, env: Optional[dict] = None, cwd: Optional[str] = None,
                 host_env: Optional[dict[int, dict]] = None):
        self.net, self.nodes, self.args, self.port = net, list(nodes), list(args), port
        self.min_nodes, self.max_restarts, self.run_id = min_nodes, max_restarts, run_id
        self.env, self.cwd = dict(env or {}), cwd
        self.host_env = dict(host_env or {})  # per host: e.g. its own host-memory folder
        self.agents: dict[int, subprocess.Popen] = {}

    def log(self, host: int) -> str:
        return os.path.join(self.net.workdir, f"agent{host}.log")

    def argv(self, host: int) -> list[str]:
        _, nproc = self.nodes[host]
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", f"{self.min_nodes}:{len(self.nodes)}", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{self.net.address(0)}:{self.port}", "--rdzv-id", self.run_id,
                "--rdzv-conf", f"is_host={int(host == 0)},{RDZV_CONF}",
                "--local-addr", self.net.address(host), "--max-restarts", str(self.max_restarts),
                *self.args]

    def start(self, host: int) -> None:
        kind, _ = self.nodes[host]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC_", "LDT_NODE_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", LDT_NODE_KIND=kind,
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **self.env,
                   **self.host_env.get(host, {}))
        with open(self.log(host), "a") as out:
            self.agents[host] = self.net.popen(host, self.argv(host), env=env, stdout=out,
                                               stderr=subprocess.STDOUT, cwd=self.cwd)

    def start_all(self) -> None:
        for host in range(len(self.nodes)):
            self.start(host)

    def kill(self, host: int) -> float:
        """Kill every process of the host (its agent and workers); returns when (monotonic)."""
        at = time.monotonic()
        self.net.kill_host(host)
        self.agents[host].wait(timeout=10)
        return at

    def returncodes(self) -> dict[int, Optional[int]]:
        return {h: a.poll() for h, a in self.agents.items()}

    def wait(self, hosts: Sequence[int], timeout: float) -> dict[int, Optional[int]]:
        """Wait until the given hosts' agents exit (None: still running at the deadline)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(self.agents[h].poll() is None for h in hosts):
            time.sleep(0.2)
        return {h: self.agents[h].poll() for h in hosts}

    def output(self, host: int) -> str:
        try:
            with open(self.log(host), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


class RunFolder:
    """What an elastic run has written so far (complete lines only: files grow while read)."""

    def __init__(self, path: str):
        self.path = path

    def _lines(self, name: str) -> list[str]:
        try:
            with open(os.path.join(self.path, name)) as f:
                text = f.read()
        except FileNotFoundError:
            return []
        return text.splitlines()[:None if text.endswith("\n") else -1]

    def rows(self) -> dict[int, dict]:
        """metrics.csv: step -> row."""
        lines = self._lines("metrics.csv")
        return {int(r["step"]): r for r in csv.DictReader(lines) if r.get("step", "").isdigit()}

    def losses(self) -> dict[int, float]:
        return {s: float(r["loss"]) for s, r in self.rows().items()}

    def worlds(self) -> list[dict]:
        """elastic.jsonl: one entry per world formed (ldt.elastic.world)."""
        return [json.loads(line) for line in self._lines("elastic.jsonl")]

    def checkpoints(self) -> list[int]:
        """Steps of the complete checkpoints."""
        done = glob.glob(os.path.join(self.path, "checkpoints", "step_*", "COMPLETE"))
        return sorted(int(os.path.basename(os.path.dirname(p))[5:]) for p in done)

    def last_step(self) -> int:
        return max(self.rows(), default=-1)


def resume_step(world: dict) -> Optional[int]:
    """The checkpoint step a world resumed from (None: a fresh start)."""
    path = world.get("resume")
    return int(os.path.basename(path.rstrip("/"))[5:]) if path else None


def wait_until(condition: Callable[[], bool], timeout: float, what: str,
               agents: Optional[ElasticAgents] = None, hosts: Sequence[int] = ()) -> float:
    """Poll ``condition`` until it holds; returns when (monotonic). On the deadline, or when
    one of ``hosts``' agents exited first, AssertionError naming ``what``."""
    end = time.monotonic() + timeout
    while not condition():
        if agents is not None and any(agents.agents[h].poll() is not None for h in hosts):
            raise AssertionError(f"waiting for {what}: the agents ended "
                                 f"{agents.returncodes()}")
        if time.monotonic() > end:
            raise AssertionError(f"waiting for {what}: nothing after {timeout:.0f} s")
        time.sleep(0.05)
    return time.monotonic()


def wait_first_step(run: RunFolder, world: dict, last_before: int, timeout: float,
                    agents: Optional[ElasticAgents] = None, hosts: Sequence[int] = ()) -> float:
    """Until ``world`` (an elastic.jsonl entry) has done its first step; returns when. Its
    metrics.csv row is told from the previous world's by waiting, when the previous world got
    further (``last_before``), for the new world to drop the rows it trains again."""
    resumed = resume_step(world)
    resumed = -1 if resumed is None else resumed
    if last_before > resumed:
        wait_until(lambda: run.last_step() <= resumed, timeout,
                   "the new world rewinding metrics.csv", agents, hosts)
    return wait_until(lambda: run.last_step() > resumed, timeout, "the new world's first step",
                      agents, hosts)
