"""Under torchrun's elastic agent: read the world torchrun formed, plan it, join ldt's world.

At every start (torchrun's first round and each restart) the workers, before any collective:

1. connect to the store torchrun gives them (``env://``: ``MASTER_ADDR``/``MASTER_PORT``;
   torchrun's ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` of this round);
2. publish their node (local rank 0 of each node: :func:`ldt.elastic.nodes.node_from_env`) and
   read every node's; torchrun's rank 0 also publishes the run folder and where it resumes;
3. plan (:func:`ldt.elastic.replan.plan_world`, the same on every rank) and compare the plan's
   digest with rank 0's: a rank with another plan stops them all with one line;
4. join the world of the ranks the plan uses, with ldt's rank of each process (the data owner's
   leader is ldt rank 0 whatever torchrun's order), over a prefix of the same store; a process
   the plan leaves idle waits until the run ends.

Every step that waits has a deadline, and an error anywhere reaches every rank as the same one
line (a node that cannot describe itself publishes its error instead of its description).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional

from ldt.config import to_cluster
from ldt.elastic.nodes import ElasticError, Node, node_from_env
from ldt.elastic.replan import WorldPlan, plan_world
from ldt.launch.lifetime import say_stop
from ldt.plan import load_inventory

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOG = "elastic.jsonl"
"""One line per world formed, in the run folder (written by ldt rank 0)."""


def check_launcher(env: Mapping[str, str]) -> None:
    """Refuse what cannot restart: no torchrun, or torchrun's shared store with restarts."""
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise ElasticError(
            f"cluster.inventory (elastic) plans the world torchrun forms, but {missing[0]} is "
            "not set: start ldt-train with torchrun --nnodes MIN:MAX --rdzv-backend c10d "
            "(docs/elastic.md), or use a cluster with fixed stages")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
            and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ElasticError(
            "torchrun shares its rendezvous store with the workers (TORCHELASTIC_USE_AGENT_STORE"
            "=True) and keeps a finished round's keys in it, so after a restart the new world "
            "cannot form (gloo dials the dead processes' addresses: measured with torch 2.13); "
            "start every torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")


@dataclass
class ElasticWorld:
    rank: Optional[int]
    """ldt's rank of this process; None: idle in this world."""
    plan: WorldPlan
    run: dict
    """From torchrun's rank 0: ``run_dir``, ``resume``, ``load``, ``complete``."""
    store: Any

    def init_process_group(self, backend: str, comm_timeout_s: float) -> None:
        """Join the world of the ranks the plan uses (ldt's ranks), over this round's store."""
        import torch.distributed as dist

        dist.init_process_group(backend, store=dist.PrefixStore("world/", self.store),
                                rank=self.rank, world_size=self.plan.world_size,
                                timeout=timedelta(seconds=comm_timeout_s))

    def wait_idle(self) -> int:
        """An idle process: wait until ldt rank 0 says the run ended (torchrun stops or
        restarts it before, when the world changes); 1 when the world ended without a word."""
        try:
            self.store.wait(["done"], timedelta(days=365))
        except Exception as exc:  # the store's host is gone: so is this world
            # on stdout, as the working ranks' progress; in the error file, as any stop
            say_stop(f"ldt: an idle process lost its world before the run ended ({exc})"
                     .split("\n")[0], sys.stdout)
            return 1
        return 0

    def settle(self, error: Optional[str]) -> None:
        """Every rank of ldt's world has checked its part of the config (its data, its
        checkpoint files): the first rank's error, if any, stops them all, with its line."""
        self.store.set(f"checked/{self.rank}", error or "")
        if self.rank == 0:
            got = [e.decode() for e in self.store.multi_get(
                [f"checked/{r}" for r in range(self.plan.world_size)])]
            first = next(((r, e) for r, e in enumerate(got) if e), None)
            self.store.set("checked", f"rank {first[0]}: {first[1]}" if first else "")
        verdict = self.store.get("checked").decode()
        if verdict:
            raise ElasticError(verdict)

    def finish(self, code: int) -> None:
        """ldt rank 0, once training ended: a finished run releases the idle processes (after
        a failure they wait for torchrun, which restarts them with the others)."""
        if self.rank == 0 and code == 0:
            try:
                self.store.set("done", "1")
            except Exception:  # the store's host is gone: the idle processes go with it
                pass

    def record(self, env: Mapping[str, str], phases: dict) -> None:
        """ldt rank 0 appends this world to ``<run_dir>/elastic.jsonl``: ``time``, when its
        process groups formed, and ``phases``, when ldt rank 0's process started, planned the
        world and had its memory checked (wall clock, seconds since the epoch, as ``time``):
        where a start after a lost host spends its time (bench_elastic)."""
        if self.rank != 0:
            return
        entry = {"time": time.time(), "phases": dict(phases),
                 "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                 "nodes": [vars(n) for n in self.plan.nodes], "world_size": self.plan.world_size,
                 "plan": self.plan.describe(), "cluster": self.plan.cluster,
                 "num_microbatches": self.plan.num_microbatches, "prefetch": self.plan.prefetch,
                 "schedule": self.plan.schedule, "resume": self.run.get("resume")}
        os.makedirs(self.run["run_dir"], exist_ok=True)
        with open(os.path.join(self.run["run_dir"], LOG), "a") as f:
            f.write(json.dumps(entry) + "\n")


def form_world(plain: dict, model, run: Optional[dict], env: Mapping[str, str] = os.environ,
               timeout_s: float = 120.0, store: Any = None) -> ElasticWorld:
    """Steps 1-3 of the module docstring; ``run``: torchrun rank 0's run folder and resume
    point, or ``{"error": line}`` (None on the other ranks). Raises :class:`ElasticError` on
    every rank alike. ``store``: torchrun's (``env://``) unless given."""
    check_launcher(env)
    import torch.distributed as dist

    rank, group, nodes_n = int(env["RANK"]), int(env["GROUP_RANK"]), int(env["GROUP_WORLD_SIZE"])
    cluster = to_cluster(plain["cluster"])  # the configured cluster, as Hydra resolved it
    inventory = load_inventory(cluster.inventory)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore("ldt/elastic/", store)
    if int(env["LOCAL_RANK"]) == 0:
        try:
            mine = node_from_env(env, [k.name for k in inventory.kinds]).to_json()
        except ElasticError as exc:
            mine = json.dumps({"error": str(exc)})
        store.set(f"node/{group}", mine)
    if rank == 0:
        store.set("run", json.dumps(run))
    texts = store.multi_get([f"node/{i}" for i in range(nodes_n)] + ["run"])
    described = [json.loads(t) for t in texts[:-1]]
    run = json.loads(texts[-1])
    errors = [d["error"] for d in [*described, run] if "error" in d]
    if errors:
        raise ElasticError(errors[0])
    nodes = [Node(**d) for d in described]
    world = plan_world(nodes, inventory, model, cluster, plain["train"])
    _agree(store, rank, int(env["WORLD_SIZE"]), world.digest())
    return ElasticWorld(world.rank_of(group, int(env["LOCAL_RANK"])), world, run, store)


def _agree(store, rank: int, world_size: int, digest: str) -> None:
    """Every rank must have planned the same: rank 0 compares the digests and says so."""
    store.set(f"digest/{rank}", digest)
    if rank == 0:
        got = [d.decode() for d in store.multi_get([f"digest/{r}" for r in range(world_size)])]
        odd = [r for r, d in enumerate(got) if d != digest]
        verdict = "ok" if not odd else (
            f"ranks {odd} planned another pipeline ({got[odd[0]]}) than rank 0 ({digest}) from "
            "the same nodes and config: the planner is not deterministic across these machines; "
            "install the same ldt, torch and numpy versions on every node")
        store.set("verdict", verdict)
    verdict = store.get("verdict").decode()
    if verdict != "ok":
        raise ElasticError(verdict)
