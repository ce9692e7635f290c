"""The elastic job: ``ldt-train`` with ``cluster.inventory`` under torchrun's elastic agent
(docs/elastic.md). Each start plans the world from the nodes that are there
(:mod:`ldt.elastic.world`), checks the plan as the configured job checks a config (files, and
the memory estimate against the ``memory_gib`` the planner wrote for every stage), then trains
in it, continuing from the run folder's newest checkpoint."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import psutil

from ldt.config import ConfigError, to_model
from ldt.config.errors import one_line
from ldt.config.errors import EXIT_CONFIG
from ldt.elastic.nodes import ElasticError
from ldt.elastic.world import form_world
from ldt.memory.report import Hosts
from ldt.plan import load_inventory
from ldt.plan.cost import message_time
from ldt.job.prepare import (Checked, build_extensions, check, check_run_dir_given,
                             discard_run_folder, join_torchrun, memory_estimate, resolve,
                             world_backend)
import ldt.launch.quiet
from ldt.launch.lifetime import say_stop
from ldt.storage.checkpoint_files import resume_auto
from ldt.storage.runlock import RunLock
from ldt.storage.snapshot_files import held
from ldt.topology.validate import planner_mtp_refusal


def elastic_job(cfg, hydra_cfg, save_hydra_files=None) -> int:
    """Under torchrun's elastic agent (docs/elastic.md): plan the world that is there from the
    nodes' descriptions, then train in it, continuing from the run folder's newest checkpoint.
    Errors are one line per node (its local rank 0 prints it). torchrun's rank 0, whose run
    folder is Hydra's, holds the folder's lock (:mod:`ldt.storage.runlock`) while it runs."""
    lock = RunLock(hydra_cfg.runtime.output_dir)
    try:
        return _elastic_job(cfg, hydra_cfg, save_hydra_files, lock)
    finally:
        lock.release()


def _elastic_job(cfg, hydra_cfg, save_hydra_files, lock) -> int:
    env = os.environ
    speak = env.get("LOCAL_RANK", "0") == "0"
    # where a start's time goes (elastic.jsonl): this process's start, by the kernel's clock
    phases = {"started": psutil.Process().create_time()}
    try:
        check_run_dir_given(hydra_cfg)
        plain = resolve(cfg, hydra_cfg.runtime.output_dir)
        _check_replannable(plain)
        run = _continued_run(plain, lock, env) if env.get("RANK") == "0" else None
        # torch and megatron-core load here, once the config is accepted

        timeout = max(120.0, 4 * plain["train"]["comm_timeout_s"])  # the nodes' start-up skew
        world = form_world(plain, to_model(plain["model"]), run, env, timeout)
        phases["planned"] = time.time()
        if world.run["complete"]:
            if speak:
                print(f"ldt-train: {world.run['complete']}", flush=True)
            return 0
        if save_hydra_files is not None:  # torchrun's rank 0, whose folder the run continues
            save_hydra_files()
        if world.rank is None:  # the plan leaves this process out of this world
            print(f"ldt-train: node {env['GROUP_RANK']} local rank {env['LOCAL_RANK']} is idle "
                  f"in this world: {world.plan.describe()}", flush=True)
            return world.wait_idle()
        checked = _planned(plain, world)
        memory = check_memory(plain, checked.topo, world)
        phases["checked"] = time.time()
    except ValueError as exc:  # ElasticError, ConfigError, LayoutError
        what = "" if isinstance(exc, ElasticError) else "invalid config: "
        return _stop(f"ldt: {what}{one_line(exc)}", EXIT_CONFIG, hydra_cfg, lock, env)
    except RuntimeError as exc:
        line = _not_formed(exc, env)
        if line is None:
            raise
        return _stop(line, 1, hydra_cfg, lock, env)
    for warning in checked.warnings:
        print(f"ldt: warning: {warning}", file=sys.stderr)
    return _train_in(world, checked, memory, env, phases)


def _stop(line: str, code: int, hydra_cfg, lock, env) -> int:
    """Stop before the world formed: the line once per node (its local rank 0 prints it), in
    every worker's torchrun error file (its summary then names the cause on every rank)."""
    say_stop(line, printed=env.get("LOCAL_RANK", "0") == "0")
    if env.get("RANK", "0") == "0":  # the one rank (or bare) with Hydra's run folder
        lock.release()
        discard_run_folder(hydra_cfg.runtime.output_dir, hydra_cfg.runtime.cwd)
    return code


def _not_formed(exc: RuntimeError, env) -> Optional[str]:
    """torch's store failing while the world forms (its waits time out when a node never
    came, died, or cannot reach the store's host), as one line; None for any other error."""
    dist = sys.modules.get("torch.distributed")  # (an error of its store: torch is loaded)
    if dist is None or not isinstance(exc, (dist.DistStoreError, dist.DistNetworkError)):
        return None
    store = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return (f"ldt: the elastic world did not form: torchrun's store at {store}: "
            f"{one_line(exc).rstrip('.')}; a rank did not get there in time (its node did not "
            f"start, stopped, or cannot reach {store}): check that every node's torchrun has "
            "the same --rdzv-endpoint, --rdzv-id and --nnodes, and that the hosts reach each "
            "other")


def _check_replannable(plain: dict) -> None:
    """What a re-planned world could not keep, refused before the world forms instead of
    dropped without a word at a start (or refused there, after a host was lost): the planner
    chooses the stages, layout and schedule at every start."""
    cluster, train = plain["cluster"], plain["train"]
    elastic = f"an elastic run (cluster.inventory={cluster.get('inventory')!r}) plans"
    if cluster.get("stages"):
        names = [st.get("name") for st in cluster["stages"]]
        raise ConfigError(f"cluster.stages={names}: {elastic} its stages anew at every start; "
                          "leave cluster.stages empty (as cluster=cpu_elastic does), or drop "
                          "cluster.inventory to train these stages")
    if cluster.get("layout"):
        raise ConfigError(f"cluster.layout={cluster['layout']!r}: {elastic} the layer split "
                          "anew at every start; leave cluster.layout out")
    if isinstance(cluster.get("link_delay_ms"), (list, tuple)):
        raise ConfigError(f"cluster.link_delay_ms={list(cluster['link_delay_ms'])}: one number "
                          f"per boundary, and {elastic} the number of boundaries anew at every "
                          "start; give one number for every boundary")
    if train.get("schedule") not in ("auto", "zb"):
        raise ConfigError(f"train.schedule={train.get('schedule')!r}: {elastic} the schedule "
                          "of each world; give train.schedule=auto (or zb, the zero-bubble "
                          "order where it fits)")
    mtp_refusal = planner_mtp_refusal(plain["model"].get("mtp_num_layers"))
    if mtp_refusal is not None:
        raise ConfigError(mtp_refusal)
    cost_run = train.get("cost_run")
    if cost_run:
        raise ConfigError(
            f"train.cost_run={cost_run!r} prices the zero-bubble order with one cluster's "
            f"measured ops, and {elastic} its stages anew at every start: leave train.cost_run "
            "out (the order is then priced by the inventory's figures)")


def _continued_run(plain: dict, lock, env) -> dict:
    """torchrun's rank 0 (whose run folder is Hydra's) locks the folder and finds what the run
    continues; every rank learns it (or why not) as the world forms."""
    try:
        lock.acquire()
        restarted = int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 \
            or held(plain["train"].get("snapshot_dir"), plain["run_dir"])  # this run's own
        complete = resume_auto(plain["train"], plain["run_dir"], elastic=True,
                               restarted=restarted)
        return {"run_dir": plain["run_dir"], "resume": plain["train"]["resume"],
                "load": plain["train"]["load"], "complete": complete}
    except ValueError as exc:  # e.g. a damaged checkpoint.json: every rank says it
        return {"error": one_line(exc)}


def _planned(plain: dict, world) -> Checked:
    """The config of the planned world, typed and validated. What only some ranks read
    (data, checkpoint files): all stop if one cannot."""
    plain["run_dir"], plain["cluster"] = world.run["run_dir"], world.plan.cluster
    plain["train"].update(num_microbatches=world.plan.num_microbatches,
                          prefetch=world.plan.prefetch, schedule=world.plan.schedule,
                          resume=world.run["resume"],
                          load=world.run["load"])
    try:
        return check(plain, world.rank, world.plan.world_size)
    except ValueError as exc:
        world.settle(one_line(exc))
        raise  # (settle raised the first rank's error already)


def _train_in(world, checked: Checked, memory: str, env, phases: dict) -> int:
    """Form the planned world's process group and train in it (``phases``: when this process
    started, planned and had the world's memory checked, recorded with the world)."""
    config, topo = checked.cfg, checked.topo
    if not build_extensions(config):
        return 1
    world.init_process_group(world_backend(config), config.train.comm_timeout_s)
    world.record(env, phases)
    if world.rank == 0:
        start = config.train.resume or "a fresh start"
        print(f"ldt-train: elastic world from {start}: {world.plan.describe()}", flush=True)
    code = 1
    try:
        code = join_torchrun(config, topo, memory=memory, priced=checked.priced)
        return code
    finally:
        world.finish(code)  # a finished run releases the idle processes


def _hosts(plan, topo, inventory: str) -> Hosts:
    """Where the planned world's ranks run (by node index), for the snapshots' host memory and
    their copies' traffic, priced on ``inventory``'s links between the nodes' kinds."""
    nodes = tuple(str(node) for node, _ in plan.placement)
    kinds = {str(n.index): n.kind for n in plan.nodes}
    links = load_inventory(inventory)
    return Hosts(nodes, nodes[topo.leader(0)] if topo.u_shape else None,
                 {str(n.index): n.host_memory_gib for n in plan.nodes},
                 send_s=lambda a, b, nbytes: message_time(nbytes, links.link(kinds[a], kinds[b])),
                 step_s=plan.iteration_s)


def check_memory(plain: dict, topo, world) -> str:
    """The planned world's memory, as the configured job checks a cluster's: the plan states
    each stage's ``memory_gib`` (the planner's limit for its kind: memory_gib - reserved_gib),
    so the estimate runs, and a stage over it stops every rank of the world (``world.settle``:
    one line, exit status 2) before any process group forms. The planner prices memory with
    its analytic model, the estimate with megatron-core's own code; they differ (e.g. by the
    sent tensors ldt's runtime holds until a step ends, docs/memory.md), so the plan is
    checked, not trusted. Every rank has the same plan, so ldt's rank 0 alone estimates, in
    its own process (no helper to start: it imports megatron-core for it, which it trains
    with next; it is local rank 0 of its node, so a device the estimate touched would be the
    one it trains on), and its verdict reaches every rank. The others import the training stack
    meanwhile, which they would do after the verdict otherwise: both are on the path from a
    lost host to the next step. Returns the estimate to print under the rank map (rank 0
    prints it)."""
    if world.rank == 0:
        hosts = _hosts(world.plan, topo, plain["cluster"]["inventory"])
        text, refused = memory_estimate(plain, topo, hosts, here=True)
    else:
        import ldt.training.loop  # noqa: F401  (torch, megatron-core: see above)
        text, refused = "", None
    world.settle(None if refused is None else f"does not fit: {refused}")
    return text
