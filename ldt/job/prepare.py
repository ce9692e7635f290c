"""What both of ``ldt-train``'s jobs do (the configured world, :mod:`ldt.job.train`, and the elastic
one, :mod:`ldt.job.elastic`): the config resolved and checked, the memory estimate's refusal, the
run folder named or discarded, joining torchrun's world and printing the summary."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from datetime import timedelta

import psutil
from typing import NamedTuple, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ldt.config import ConfigError, LdtConfig, to_cluster, typed_config
from ldt.data.files import format_blend, parse_blend
from ldt.launch.lifetime import say_stop
from ldt.launch.quiet import set_log_level
from ldt.memory import needs_estimate
from ldt.memory import report as memory_report
from ldt.models.extensions import BuildError, build_for
from ldt.plan.zb_prices import run_prices
from ldt.schedule.zerobubble import Priced
from ldt.storage.atomic import replace_file
from ldt.storage.checkpoint_files import AUTO
from ldt.storage.runlock import check_not_training, run_of
from ldt.topology.device import backend_for
from ldt.topology.ranks import Topology
from ldt.topology.validate import check_files, validate
from ldt.training.outputs import summary_json

def check_run_dir_given(hydra_cfg) -> None:
    """train.resume=auto and elastic runs continue a run folder: it must be named, the same at
    every start (Hydra's default is a new time-stamped folder each time)."""
    task, hydra = list(hydra_cfg.overrides.task), list(hydra_cfg.overrides.hydra)
    if any(o.startswith("run_dir=") for o in task) or any(
            o.startswith("hydra.run.dir=") and o != "hydra.run.dir=." for o in hydra):
        return
    raise ConfigError("train.resume=auto (the default of an elastic run, cluster.inventory) "
                      "continues from the run folder's newest checkpoint, so the folder must be "
                      "the same at every start: give run_dir=DIR (on a filesystem every node "
                      "shares)")


def discard_run_folder(path: str, cwd: str, ours: bool = False) -> None:
    """A refused config leaves no run folder behind: Hydra made it before the job could
    validate (empty: ``.hydra/`` is written only once the config is accepted). Removed only
    when empty and made by this process, with the parents it leaves empty below the working
    directory (``outputs/<date>``). ``ours``: the caller knows this process made the folder
    (:func:`new_run_folder`, asked before anything was written there), so it is removed with
    whatever this process wrote into it (a ``.hydra/`` a full disk cut short)."""
    if not os.path.isdir(path) or (not ours and (os.listdir(path)
                                                 or not _made_by_this_process(path))):
        return
    shutil.rmtree(path, ignore_errors=True)
    parent = os.path.dirname(path)
    while parent.startswith(cwd + os.sep) and os.path.isdir(parent) and not os.listdir(parent):
        try:
            os.rmdir(parent)
        except OSError:  # a mount point, a folder another process just wrote into
            return
        parent = os.path.dirname(parent)


def new_run_folder(path: str) -> bool:
    """Is ``path`` an empty folder this process made (Hydra, just now)? Ask it before
    anything is written there: an entry made later changes the folder's time too."""
    return os.path.isdir(path) and not os.listdir(path) and _made_by_this_process(path)


def _made_by_this_process(path: str) -> bool:
    """Hydra made ``path`` in this process (an empty folder the user had is left alone)."""
    return os.stat(path).st_ctime >= psutil.Process().create_time()  # (rounded down)


def resolve(cfg, run_dir: str) -> dict:
    """The composed config as a plain dict, run folder and paths made absolute."""
    from hydra.utils import to_absolute_path

    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc}".strip()) from None
    plain["run_dir"] = os.path.abspath(run_dir)
    # relative to where ldt-train was started, also under hydra.job.chdir=true
    for group, key in (("data", "path"), ("data", "tokenizer"), ("data", "cache_dir"),
                       ("train", "resume"), ("train", "load")):
        value = plain[group].get(key)
        if value and not (key == "tokenizer" and value == "bytes") \
                and not (key == "resume" and value == AUTO):
            plain[group][key] = to_absolute_path(value)
    if plain["data"].get("blend") is not None:
        plain["data"]["blend"] = format_blend(*parse_blend(plain["data"]["blend"],
                                                           base=to_absolute_path(".")))
    return plain


class Checked(NamedTuple):
    """A config checked for its world: what the ranks receive."""

    cfg: LdtConfig
    topo: Topology
    warnings: list
    priced: Optional[Priced]
    """``train.schedule=zb``: the plan's prices its order is generated from, computed by the
    launcher or torchrun's rank 0 alone, which hands them to every rank (a ``train.cost_run``
    folder is read on its host only); None elsewhere."""


def check(plain: dict, rank: Optional[int], world: Optional[int]) -> Checked:
    """Type and validate a resolved config for a world of ``world`` processes, once."""
    first = rank in (None, 0)
    if first:
        _not_a_live_run(plain)
    cfg = typed_config(plain)
    if rank is not None and cfg.train.verify:
        raise ConfigError("train.verify=true under torchrun: the single-process reference runs "
                          "only beside the bare launcher's world, so no parity would be "
                          "checked; check it with ldt-train on one machine, or drop "
                          "train.verify")
    topo = validate(cfg.cluster, cfg.model, world_size=world, train=cfg.train, rank=rank)
    priced = run_prices(cfg.cluster, cfg.model, cfg.train) \
        if cfg.train.schedule == "zb" and first else None
    warnings = check_files(cfg.data, cfg.model, cfg.train, topo, rank)
    return Checked(cfg, topo, warnings, priced)


def _not_a_live_run(plain: dict) -> None:
    """Refuse ``train.resume`` / ``train.load`` in the folder of another run that is training
    now (:func:`ldt.storage.runlock.check_not_training`); this run's own folder, which it
    continues under its own lock, is its own."""
    train = plain["train"]
    path = train.get("resume") or train.get("load")
    if path and path != AUTO and run_of(path) != os.path.abspath(plain["run_dir"]):
        check_not_training(path, f"train.{'resume' if train.get('resume') else 'load'}={path}")


def save_config(cfg: LdtConfig, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    replace_file(os.path.join(run_dir, "config.yaml"),
                 OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def join_torchrun(cfg: LdtConfig, topo, auto: bool = False, complete: Optional[str] = None,
                   memory: str = "", priced: Optional[Priced] = None) -> int:
    """Under torchrun: join its world; the loss stage's leader prints the summary. ``auto``:
    rank 0 resolved ``train.resume=auto`` (``complete``: the run needs nothing more). A failure
    is one line from each failing rank (and its exit status), not a traceback: no launcher of
    ldt's sees the whole world to name the rank that failed first (ldt.training.failure)."""
    rank = int(os.environ["RANK"])
    # the rank's log level before megatron-core is imported (its import logs INFO records,
    # which Hydra's handler would print from every rank)
    set_log_level(cfg.train.log_level, rank)
    # torch and megatron-core load here, once the config is accepted: ldt-train refuses a
    # config that cannot work in about a second
    from ldt.training import failure

    doing = failure.track_progress()
    try:
        return _train_in_torchrun_world(cfg, topo, auto, complete, memory, priced)
    except (Exception, KeyboardInterrupt) as exc:
        return failure.report(exc, failure.rank_label(topo, rank), seen=doing())


def _train_in_torchrun_world(cfg: LdtConfig, topo, auto: bool, complete: Optional[str],
                             memory: str = "", priced: Optional[Priced] = None) -> int:
    import torch.distributed as dist

    from ldt.training.loop import train_worker

    if not dist.is_initialized():  # an elastic world joined in ldt.elastic.world
        dist.init_process_group(world_backend(cfg),
                                timeout=timedelta(seconds=cfg.train.comm_timeout_s))
    # rank 0's run folder (only it kept Hydra's), what train.resume=auto found there and the
    # zero-bubble order's prices (priced there alone)
    holder = [cfg.run_dir, (cfg.train.resume, cfg.train.load, complete), priced]
    dist.broadcast_object_list(holder, src=0)
    cfg.run_dir, priced = holder[0], holder[2]
    if auto:
        cfg.train.resume, cfg.train.load, complete = holder[1]
    if complete:
        if dist.get_rank() == 0:
            print(f"ldt-train: {complete}", flush=True)
        dist.destroy_process_group()
        return 0
    if dist.get_rank() == 0:
        print(f"ldt-train: run folder {holder[0]}\n{topo.rank_map()}{memory}", flush=True)
        save_config(cfg, holder[0])
    summary = train_worker(dist.get_rank(), dist.get_world_size(), cfg, holder[0], topo=topo,
                           priced=priced, hold_signals_after_failure=True)
    code = 0
    if summary is not None and summary.get("stopped"):
        say_stop(f"ldt: {summary['stopped'].message}")
        code = summary["stopped"].exit_code
    elif summary is not None:
        print(summary_line(summary), flush=True)
    dist.destroy_process_group()
    return code


def build_extensions(cfg: LdtConfig) -> bool:
    """megatron-core's C++ extension, built before the world forms when the run needs it
    (:mod:`ldt.models.extensions`: inside the first backward a build outlasts the boundary
    timeout). False after saying why it cannot be built."""
    try:
        build_for(cfg.model, cfg.cluster.stages, say=os.environ.get("LOCAL_RANK", "0") == "0")
    except BuildError as exc:
        say_stop(f"ldt: {exc}")
        return False
    return True


def world_backend(cfg: LdtConfig) -> str:
    """The default group's backend: native when every stage has one device type, else gloo."""
    devices = {s.device for s in cfg.cluster.stages}
    return backend_for(devices.pop()) if len(devices) == 1 else "gloo"


def summary_line(summary: dict) -> str:
    return summary_json(_public(summary))


def _public(summary: dict) -> dict:
    keys = ("steps", "first_step", "final_loss", "first_loss", "eval_loss", "moe_aux_loss",
            "final_mtp_loss",
            "tokens_per_s", "step_time_s", "parity_max_abs_diff", "run_dir")
    return {k: summary[k] for k in keys if k in summary}


def memory_check(plain: dict, topo, rank: Optional[int]) -> Optional[str]:
    """With ``train.estimate_memory`` (by default: when a stage states ``memory_gib``), the
    per-stage estimate to print under the rank map; None (after saying why) when a stage does
    not fit. Every rank of a torchrun world estimates alike, so all refuse together; but a
    zero-bubble order priced by ``train.cost_run`` is rank 0's alone (the folder need be on
    its host only, :func:`check`), so rank 0 alone estimates it and its refusal stops the
    world."""
    if rank not in (None, 0) and plain["train"].get("cost_run"):
        return ""
    text, refused = memory_estimate(plain, topo)
    if refused is not None:
        where = f" (rank {rank})" if rank is not None else ""
        say_stop(f"ldt: does not fit{where}: {refused}")
        return None
    return text


def memory_estimate(plain: dict, topo, hosts=None, here: bool = False
                    ) -> tuple[str, Optional[str]]:
    """``(text, refusal)``: the estimate to print under the rank map ("" when not asked for, or
    when the estimate itself failed: a forecast stops nothing), and the one-line refusal of the
    first stage over its ``memory_gib`` or host without room for its snapshots (``hosts``,
    :class:`ldt.memory.report.Hosts`: an elastic world's) (None when everything fits).
    ``here``: estimate in this process (the elastic job's rank 0 before its world forms: it
    has no process group yet and imports megatron-core next anyway; a helper would start
    Python, torch and megatron-core a second time, ~3 s of a recovery on this machine), not in
    a helper."""
    if not needs_estimate(plain):
        return "", None
    try:
        stages = None
        if here:
            from ldt.memory.stages import estimate_here  # torch, megatron-core: here, now

            stages = estimate_here(plain)
        text, refused = memory_report.check(plain, topo, hosts, stages)
    except Exception as exc:
        if getattr(exc, "stopped_by", None):  # Ctrl-C / SIGTERM: the user stops the launch
            raise
        # a failed helper world's first line is "rank 0 failed": its traceback's last says why
        tb = getattr(exc, "tb", "").strip()
        why = tb.splitlines()[-1] if tb else str(exc).splitlines()[0]
        print(f"ldt: warning: the memory estimate failed ({why}); starting without it",
              file=sys.stderr)
        return "", None
    return "\n" + text, refused


def reference_config(cfg: LdtConfig | dict) -> LdtConfig:
    """The single-process reference of ``train.verify``: one stage, TP 1, the same global batch
    (per-stage dp: the largest, docs/vdp.md)."""
    cfg = typed_config(cfg)
    dp = max([cfg.cluster.dp] + [st.dp for st in cfg.cluster.stages if st.dp is not None])
    cluster = to_cluster({"stages": [{"name": "reference", "device": "cpu", "tp": 1}],
                          "u_shape": False, "layout": None, "dp": 1})
    train = replace(cfg.train, num_microbatches=dp * cfg.train.num_microbatches,
                    audit_comm=False, schedule="auto", cost_run=None, cost_inventory=None,
                    overlap_p2p_comm=False, prefetch=0)
    return replace(cfg, cluster=cluster, train=train)
