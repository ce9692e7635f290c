"""``ldt-train``: the main job, a Hydra app over ``conf/`` (Hydra's own command line).

``ldt-train [overrides]`` composes the config and validates it (types, numbers, the layout,
the data file, the resume folder) before torch or megatron-core is imported, so a config that
cannot work is refused in about a second, with exit status 2 and one line naming the field,
the value and the fix. It then says what it starts and either joins a torchrun world (RANK /
WORLD_SIZE set) or, launched bare, starts the cluster's world itself on this machine (gloo on
127.0.0.1). The run folder is Hydra's (``hydra.run.dir``; ``run_dir=`` is an alias; with
``-m`` one sub-folder per job) and gets the resolved config, ``metrics.csv`` and the measured
timeline; the last line a run prints is one JSON object (steps, final_loss, eval_loss with
train.eval_every, tokens_per_s, step_time_s, and parity_max_abs_diff with
``train.verify=true``). ``ldt-train --help`` lists the groups and the switches that matter.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Optional, Sequence

from ldt.errors import one_line
from ldt.hydra_app import EXIT_CONFIG
from ldt.storage.checkpoint_files import AUTO, resume_auto


def main(argv: Sequence[str] | None = None) -> int:
    from ldt.hydra_app import run_app

    return run_app(_job, argv)


def _job(cfg, save_hydra_files=None) -> int:
    """One run (one job of a multirun): validate, say what starts, then launch or join.
    ``save_hydra_files``: writes Hydra's ``.hydra/`` (rank 0 only; see ``run_app``)."""
    from hydra.core.hydra_config import HydraConfig

    from ldt.storage.atomic import check_run_folder

    hydra_cfg = HydraConfig.get()
    rank = int(os.environ["RANK"]) if "RANK" in os.environ else None
    if cfg.cluster.get("inventory"):  # elastic: the stages are planned from the nodes there
        return _elastic_job(cfg, hydra_cfg, save_hydra_files)
    try:
        if cfg.train.get("resume") == AUTO:
            _check_run_dir_given(hydra_cfg)
        plain, topo, warnings = prepare(cfg, hydra_cfg.runtime.output_dir, rank)
        complete = plain.pop("run_complete", None)
        if complete and rank is None:
            print(f"ldt-train: {complete}", flush=True)
            return 0
        if save_hydra_files is not None:  # the folder that keeps the run's files
            check_run_folder(plain["run_dir"], _resuming(cfg, plain))
        for warning in warnings:
            print(f"ldt: warning: {warning}", file=sys.stderr)
        memory = _memory_check(plain, topo, rank)  # before .hydra/: a refusal leaves no folder
        if memory is not None and save_hydra_files is not None:
            save_hydra_files()
    except ValueError as exc:  # ConfigError, LayoutError: the config cannot work
        where = f" (rank {rank})" if rank is not None else ""
        print(f"ldt: invalid config{where}: {one_line(exc)}", file=sys.stderr)
        _discard_run_folder(hydra_cfg.runtime.output_dir, hydra_cfg.runtime.cwd)
        return EXIT_CONFIG
    if memory is None:
        _discard_run_folder(hydra_cfg.runtime.output_dir, hydra_cfg.runtime.cwd)
        return EXIT_CONFIG
    choices = hydra_cfg.runtime.choices
    what = (f"cluster={choices.get('cluster')} model={choices.get('model')}: {topo.num_stages} "
            f"stages, TP {topo.tp_sizes}, dp {topo.dp}"
            + (", U-shape" if topo.u_shape else ""))
    if rank is not None:
        if rank == 0:
            print(f"ldt-train: {what}; joining torchrun's world of {topo.world_size} processes",
                  flush=True)
        return _join_torchrun(plain, topo, auto=cfg.train.get("resume") == AUTO,
                              complete=complete, memory=memory)
    print(f"ldt-train: {what}; starting {topo.world_size} processes on this machine\n"
          f"ldt-train: run folder {plain['run_dir']}\n{topo.rank_map()}{memory}", flush=True)
    return _launch_local(plain, topo)


def _memory_check(plain: dict, topo, rank: Optional[int]) -> Optional[str]:
    """With ``train.estimate_memory`` (by default: when a stage states ``memory_gib``), the
    per-stage estimate to print under the rank map; None (after saying why) when a stage does
    not fit. Every rank of a torchrun world estimates alike, so all refuse together."""
    from ldt.memory import needs_estimate

    if not needs_estimate(plain):
        return ""
    from ldt.memory.report import check

    try:
        text, refused = check(plain, topo)
    except Exception as exc:  # the estimate is a forecast: a failure of it stops nothing
        print(f"ldt: warning: the memory estimate failed ({str(exc).splitlines()[0]}); "
              "starting without it", file=sys.stderr)
        return ""
    if refused is not None:
        where = f" (rank {rank})" if rank is not None else ""
        print(f"ldt: does not fit{where}: {refused}", file=sys.stderr)
        return None
    return "\n" + text


def _elastic_job(cfg, hydra_cfg, save_hydra_files=None) -> int:
    """Under torchrun's elastic agent (docs/elastic.md): plan the world that is there from the
    nodes' descriptions, then train in it, continuing from the run folder's newest checkpoint.
    Errors are one line per node (its local rank 0 prints it)."""
    from ldt.config import to_model
    from ldt.elastic.nodes import ElasticError

    env = os.environ
    speak = env.get("LOCAL_RANK", "0") == "0"
    try:
        _check_run_dir_given(hydra_cfg)
        plain = resolve(cfg, hydra_cfg.runtime.output_dir)
        run = None
        if env.get("RANK") == "0":  # the one rank whose run folder is Hydra's
            try:
                complete = resume_auto(plain["train"], plain["run_dir"], elastic=True)
                run = {"run_dir": plain["run_dir"], "resume": plain["train"]["resume"],
                       "load": plain["train"]["load"], "complete": complete}
            except ValueError as exc:  # e.g. a damaged checkpoint.json: every rank says it
                run = {"error": one_line(exc)}
        import ldt.quiet  # noqa: F401  (before megatron-core is imported)
        from ldt.elastic.world import form_world

        timeout = max(120.0, 4 * plain["train"]["comm_timeout_s"])  # the nodes' start-up skew
        world = form_world(plain, to_model(plain["model"]), run, env, timeout)
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
        plain["run_dir"], plain["cluster"] = world.run["run_dir"], world.plan.cluster
        plain["train"].update(num_microbatches=world.plan.num_microbatches,
                              prefetch=world.plan.prefetch, resume=world.run["resume"],
                              load=world.run["load"])
        try:  # what only some ranks read (data, checkpoint files): all stop if one cannot
            topo, warnings = check(plain, world.rank, world.plan.world_size)
        except ValueError as exc:
            world.settle(one_line(exc))
        world.settle(None)
    except ValueError as exc:  # ElasticError, ConfigError, LayoutError
        if speak:
            what = "" if isinstance(exc, ElasticError) else "invalid config: "
            print(f"ldt: {what}{one_line(exc)}", file=sys.stderr, flush=True)
        if env.get("RANK", "0") == "0":  # the one rank (or bare) with Hydra's run folder
            _discard_run_folder(hydra_cfg.runtime.output_dir, hydra_cfg.runtime.cwd)
        return EXIT_CONFIG
    for warning in warnings:
        print(f"ldt: warning: {warning}", file=sys.stderr)
    world.init_process_group(_world_backend(plain), plain["train"]["comm_timeout_s"])
    world.record(env)
    if world.rank == 0:
        start = plain["train"]["resume"] or "a fresh start"
        print(f"ldt-train: elastic world from {start}: {world.plan.describe()}", flush=True)
    code = 1
    try:
        code = _join_torchrun(plain, topo)
        return code
    finally:
        world.finish(code)  # a finished run releases the idle processes


def _resuming(cfg, plain: dict) -> Optional[str]:
    """What the run continues, for the run-folder check: train.resume, or with auto (even
    when it found no checkpoint yet) the run folder itself, which is then the run's own."""
    return plain["train"]["resume"] or (plain["run_dir"] if cfg.train.get("resume") == AUTO
                                        else None)


def _check_run_dir_given(hydra_cfg) -> None:
    """train.resume=auto and elastic runs continue a run folder: it must be named, the same at
    every start (Hydra's default is a new time-stamped folder each time)."""
    from ldt.config import ConfigError

    task, hydra = list(hydra_cfg.overrides.task), list(hydra_cfg.overrides.hydra)
    if any(o.startswith("run_dir=") for o in task) or any(
            o.startswith("hydra.run.dir=") and o != "hydra.run.dir=." for o in hydra):
        return
    raise ConfigError("train.resume=auto (the default of an elastic run, cluster.inventory) "
                      "continues from the run folder's newest checkpoint, so the folder must be "
                      "the same at every start: give run_dir=DIR (on a filesystem every node "
                      "shares)")


def _discard_run_folder(path: str, cwd: str) -> None:
    """A refused config leaves no run folder behind: Hydra made it before the job could
    validate (empty: ``.hydra/`` is written only once the config is accepted). Removed only
    when empty, with the parents it leaves empty below the working directory
    (``outputs/<date>``)."""
    import shutil

    if not os.path.isdir(path) or os.listdir(path) or not _made_by_this_process(path):
        return
    shutil.rmtree(path, ignore_errors=True)
    parent = os.path.dirname(path)
    while parent.startswith(cwd + os.sep) and os.path.isdir(parent) and not os.listdir(parent):
        os.rmdir(parent)
        parent = os.path.dirname(parent)


def _made_by_this_process(path: str) -> bool:
    """Hydra made ``path`` in this process (an empty folder the user had is left alone)."""
    import psutil

    return os.stat(path).st_ctime >= psutil.Process().create_time()  # (rounded down)


def prepare(cfg, run_dir: str, rank: Optional[int] = None):
    """The composed config as a plain dict (run folder and paths made absolute), validated:
    ``(cfg, topology, warnings)``; raises ConfigError. Imports neither torch nor megatron.
    ``train.resume=auto`` is resolved where the run folder is known (bare, torchrun's rank 0;
    the others learn it from rank 0); ``cfg["run_complete"]`` then says when nothing is left."""
    plain = resolve(cfg, run_dir)
    if plain["train"].get("resume") == AUTO:
        if rank in (None, 0):
            plain["run_complete"] = resume_auto(plain["train"], plain["run_dir"])
        else:  # torchrun's other ranks learn it from rank 0 (_join_torchrun)
            plain["train"]["resume"] = None
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    topo, warnings = check(plain, rank, world)
    return plain, topo, warnings


def resolve(cfg, run_dir: str) -> dict:
    """The composed config as a plain dict, run folder and paths made absolute."""
    from hydra.utils import to_absolute_path
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ldt.config import ConfigError

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
        from ldt.data.files import format_blend, parse_blend

        plain["data"]["blend"] = format_blend(*parse_blend(plain["data"]["blend"],
                                                           base=to_absolute_path(".")))
    return plain


def check(plain: dict, rank: Optional[int], world: Optional[int]):
    """Validate a resolved config for a world of ``world`` processes: (topology, warnings)."""
    from ldt.validate import check_files, validate

    topo = validate(plain["cluster"], plain["model"], world_size=world, train=plain["train"])
    warnings = check_files(plain["data"], plain["model"], plain["train"], topo, rank)
    return topo, warnings


def _save_config(cfg: dict, run_dir: str) -> None:
    from omegaconf import OmegaConf

    from ldt.storage.atomic import replace_file

    os.makedirs(run_dir, exist_ok=True)
    replace_file(os.path.join(run_dir, "config.yaml"), OmegaConf.to_yaml(OmegaConf.create(cfg)))


def _launch_local(cfg: dict, topo) -> int:
    """Bare launch: start the whole world here; every child is reaped whatever happens."""
    import ldt.quiet  # noqa: F401  (before megatron-core is imported)
    from ldt.launch import WorldError, run_local_world
    from ldt.training.loop import reference_config, train_worker

    run_dir = os.path.abspath(cfg["run_dir"])
    _save_config(cfg, run_dir)
    timeout = cfg["train"]["comm_timeout_s"]
    # prepare() (check_files with every rank local) checked the checkpoint's checksums
    verified = bool(cfg["train"]["resume"] or cfg["train"].get("load"))
    try:
        results = run_local_world(topo.world_size, train_worker, (cfg, run_dir, verified),
                                  timeout_s=_job_timeout(cfg), comm_timeout_s=timeout,
                                  stop_grace_s=max(120.0, 2 * timeout))
    except WorldError as exc:
        if exc.stopped_by:
            return _stopped_early(exc, run_dir)
        print(f"ldt: training failed: {_describe(exc, topo)}", file=sys.stderr)
        return 1
    summary = next(r for r in results if r is not None)
    if summary.get("stopped"):
        print(f"ldt: {summary['stopped'].message}", file=sys.stderr)
        return summary["stopped"].exit_code
    if cfg["train"]["verify"]:
        ref = run_local_world(1, train_worker, (reference_config(cfg), os.path.join(run_dir, "reference")),
                              timeout_s=_job_timeout(cfg), comm_timeout_s=timeout)[0]
        from ldt.training.outputs import parity_max_abs_diff

        try:
            summary["parity_max_abs_diff"] = parity_max_abs_diff(summary, ref)
        except ValueError as exc:
            print(f"ldt: {exc}", file=sys.stderr)
            print(_summary_line(summary))
            return 1
    print(_summary_line(summary))
    return 0


def _stopped_early(exc, run_dir: str) -> int:
    """A stop signal ended the world before the ranks reached a step boundary."""
    import signal

    from ldt.storage.checkpoint_files import latest

    name = signal.Signals(exc.stopped_by).name
    last = latest(run_dir)
    print(f"ldt: stopped by {name} before a step boundary ({exc.message.splitlines()[0]}); "
          f"the last complete checkpoint is {last or 'none'}", file=sys.stderr)
    return 128 + exc.stopped_by


def _summary_line(summary: dict) -> str:
    from ldt.training.outputs import summary_json

    return summary_json(_public(summary))


def _join_torchrun(cfg: dict, topo, auto: bool = False, complete: Optional[str] = None,
                   memory: str = "") -> int:
    """Under torchrun: join its world; the loss stage's leader prints the summary. ``auto``:
    rank 0 resolved ``train.resume=auto`` (``complete``: the run needs nothing more). A failure
    is one line from each failing rank (and its exit status), not a traceback: no launcher of
    ldt's sees the whole world to name the rank that failed first (ldt.training.failure)."""
    import ldt.quiet  # noqa: F401  (before megatron-core is imported)
    from ldt.training import failure

    rank = int(os.environ["RANK"])
    doing = failure.track_progress()
    try:
        return _train_in_torchrun_world(cfg, topo, auto, complete, memory)
    except (Exception, KeyboardInterrupt) as exc:
        return failure.report(exc, failure.rank_label(topo, rank), seen=doing())


def _train_in_torchrun_world(cfg: dict, topo, auto: bool, complete: Optional[str],
                             memory: str = "") -> int:
    import torch.distributed as dist

    from ldt.training.loop import train_worker

    if not dist.is_initialized():  # an elastic world joined in ldt.elastic.world
        dist.init_process_group(_world_backend(cfg),
                                timeout=timedelta(seconds=cfg["train"]["comm_timeout_s"]))
    # rank 0's run folder (only it kept Hydra's) and what train.resume=auto found there
    holder = [cfg["run_dir"], (cfg["train"]["resume"], cfg["train"]["load"], complete)]
    dist.broadcast_object_list(holder, src=0)
    cfg["run_dir"] = holder[0]
    if auto:
        cfg["train"]["resume"], cfg["train"]["load"], complete = holder[1]
    if complete:
        if dist.get_rank() == 0:
            print(f"ldt-train: {complete}", flush=True)
        dist.destroy_process_group()
        return 0
    if dist.get_rank() == 0:
        print(f"ldt-train: run folder {holder[0]}\n{topo.rank_map()}{memory}", flush=True)
        _save_config(cfg, holder[0])
    summary = train_worker(dist.get_rank(), dist.get_world_size(), cfg, holder[0])
    code = 0
    if summary is not None and summary.get("stopped"):
        print(f"ldt: {summary['stopped'].message}", file=sys.stderr, flush=True)
        code = summary["stopped"].exit_code
    elif summary is not None:
        print(_summary_line(summary), flush=True)
    dist.destroy_process_group()
    return code


def _world_backend(cfg: dict) -> str:
    """The default group's backend: native when every stage has one device type, else gloo."""
    from ldt.device import backend_for

    devices = {s["device"] for s in cfg["cluster"]["stages"]}
    return backend_for(devices.pop()) if len(devices) == 1 else "gloo"


def _job_timeout(cfg: dict) -> float:
    """A generous whole-job limit for bare launches (the comm timeout catches hangs first)."""
    return max(600.0, 30.0 * cfg["train"]["steps"])


def _describe(exc, topo) -> str:
    if exc.rank is None:
        return str(exc)
    from ldt.training.failure import rank_label

    where = rank_label(topo, exc.rank)
    if exc.stalled:  # "rank N stopped making progress: ...": the others waited for it
        return str(exc).replace(f"rank {exc.rank} ", f"{where} ", 1)
    return f"{where} failed first: {exc}"


def _public(summary: dict) -> dict:
    keys = ("steps", "first_step", "final_loss", "first_loss", "eval_loss", "moe_aux_loss",
            "final_mtp_loss",
            "tokens_per_s", "step_time_s", "parity_max_abs_diff", "run_dir")
    return {k: summary[k] for k in keys if k in summary}


if __name__ == "__main__":
    sys.exit(main())
