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

import os
import subprocess
import sys
import time
from typing import Optional, Sequence

from ldt.testing.hosts import Hosts

RDZV_PORT = 29400
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


class ElasticAgents:
    """One torchrun agent per host; ``nodes[i] = (LDT_NODE_KIND, --nproc-per-node)`` of host i.

    ``args``: what torchrun runs (e.g. ``["-m", "ldt.train", "cluster=cpu_elastic", ...]``).
    Every agent's output (its workers' included) goes to ``<workdir>/agent<i>.log``, appended
    across restarts of the host.
    """

    def __init__(self, net: Hosts, nodes: Sequence[tuple[str, int]], args: Sequence[str], *,
                 min_nodes: int, max_restarts: int = 3, run_id: str = "ldt",
                 env: Optional[dict] = None, cwd: Optional[str] = None):
        self.net, self.nodes, self.args = net, list(nodes), list(args)
        self.min_nodes, self.max_restarts, self.run_id = min_nodes, max_restarts, run_id
        self.env, self.cwd = dict(env or {}), cwd
        self.agents: dict[int, subprocess.Popen] = {}

    def log(self, host: int) -> str:
        return os.path.join(self.net.workdir, f"agent{host}.log")

    def argv(self, host: int) -> list[str]:
        _, nproc = self.nodes[host]
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", f"{self.min_nodes}:{len(self.nodes)}", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{self.net.address(0)}:{RDZV_PORT}", "--rdzv-id", self.run_id,
                "--rdzv-conf", f"is_host={int(host == 0)},{RDZV_CONF}",
                "--local-addr", self.net.address(host), "--max-restarts", str(self.max_restarts),
                *self.args]

    def start(self, host: int) -> None:
        kind, _ = self.nodes[host]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC_", "LDT_NODE_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", LDT_NODE_KIND=kind,
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **self.env)
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
