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

from ldt.hydra_app import EXIT_CONFIG


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
    try:
        plain, topo, warnings = prepare(cfg, hydra_cfg.runtime.output_dir, rank)
        if save_hydra_files is not None:  # the folder that keeps the run's files
            check_run_folder(plain["run_dir"], plain["train"]["resume"])
            save_hydra_files()
    except ValueError as exc:  # ConfigError, LayoutError: the config cannot work
        where = f" (rank {rank})" if rank is not None else ""
        print(f"ldt: invalid config{where}: {one_line(exc)}", file=sys.stderr)
        _discard_run_folder(hydra_cfg.runtime.output_dir, hydra_cfg.runtime.cwd)
        return EXIT_CONFIG
    for warning in warnings:
        print(f"ldt: warning: {warning}", file=sys.stderr)
    choices = hydra_cfg.runtime.choices
    what = (f"cluster={choices.get('cluster')} model={choices.get('model')}: {topo.num_stages} "
            f"stages, TP {topo.tp_sizes}, dp {topo.dp}"
            + (", U-shape" if topo.u_shape else ""))
    if rank is not None:
        if rank == 0:
            print(f"ldt-train: {what}; joining torchrun's world of {topo.world_size} processes",
                  flush=True)
        return _join_torchrun(plain, topo)
    print(f"ldt-train: {what}; starting {topo.world_size} processes on this machine\n"
          f"ldt-train: run folder {plain['run_dir']}\n{topo.rank_map()}", flush=True)
    return _launch_local(plain, topo)


def one_line(exc: BaseException) -> str:
    """A refusal's message on one line (a layout error's caret picture left out)."""
    return exc.one_line() if hasattr(exc, "one_line") else " ".join(str(exc).split())


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
    ``(cfg, topology, warnings)``; raises ConfigError. Imports neither torch nor megatron."""
    from hydra.utils import to_absolute_path
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ldt.config import ConfigError
    from ldt.validate import check_files, validate

    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc}".strip()) from None
    plain["run_dir"] = os.path.abspath(run_dir)
    # relative to where ldt-train was started, also under hydra.job.chdir=true
    for group, key in (("data", "path"), ("data", "tokenizer"), ("data", "cache_dir"),
                       ("train", "resume"), ("train", "load")):
        value = plain[group].get(key)
        if value and not (key == "tokenizer" and value == "bytes"):
            plain[group][key] = to_absolute_path(value)
    if plain["data"].get("blend") is not None:
        from ldt.data.files import format_blend, parse_blend

        plain["data"]["blend"] = format_blend(*parse_blend(plain["data"]["blend"],
                                                           base=to_absolute_path(".")))
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    topo = validate(plain["cluster"], plain["model"], world_size=world, train=plain["train"])
    warnings = check_files(plain["data"], plain["model"], plain["train"], topo, rank)
    return plain, topo, warnings


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
        pairs = [*zip(summary["losses"], ref["losses"]),
                 *zip(summary.get("eval_losses", []), ref.get("eval_losses", [])),
                 *zip(summary.get("moe_aux_losses", []), ref.get("moe_aux_losses", []))]
        summary["parity_max_abs_diff"] = max(abs(a - b) for a, b in pairs)
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


def _join_torchrun(cfg: dict, topo) -> int:
    """Under torchrun: join its world; the loss stage's leader prints the summary."""
    import ldt.quiet  # noqa: F401  (before megatron-core is imported)
    import torch.distributed as dist

    from ldt.training.loop import train_worker

    backend = _world_backend(cfg)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg["train"]["comm_timeout_s"]))
    holder = [cfg["run_dir"]]
    dist.broadcast_object_list(holder, src=0)  # rank 0's run folder (only it kept Hydra's)
    cfg["run_dir"] = holder[0]
    if dist.get_rank() == 0:
        print(f"ldt-train: run folder {holder[0]}\n{topo.rank_map()}", flush=True)
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
    info = topo.rank_info(exc.rank) if exc.rank < topo.world_size else None
    where = f"rank {exc.rank}"
    if info is not None:
        where += f" (stage {info.stage} '{topo.stages[info.stage].name}', TP rank {info.tp_rank})"
    if exc.stalled:  # "rank N stopped making progress: ...": the others waited for it
        return str(exc).replace(f"rank {exc.rank} ", f"{where} ", 1)
    return f"{where} failed first: {exc}"


def _public(summary: dict) -> dict:
    keys = ("steps", "first_step", "final_loss", "first_loss", "eval_loss", "moe_aux_loss",
            "tokens_per_s", "step_time_s", "parity_max_abs_diff", "run_dir")
    return {k: summary[k] for k in keys if k in summary}


if __name__ == "__main__":
    sys.exit(main())
