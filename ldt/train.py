"""``ldt-train``: the main job, a Hydra app over ``conf/``.

``ldt-train [overrides]`` composes and validates the config (on every rank, before any
collective), then either joins a torchrun world (RANK / WORLD_SIZE set) or, launched bare,
starts the cluster's world itself on this machine (gloo on 127.0.0.1). The run folder gets the
resolved config, ``metrics.csv`` and the measured timeline; the last line printed is one JSON
object (steps, final_loss, eval_loss with train.eval_every, tokens_per_s, step_time_s, and
parity_max_abs_diff with ``train.verify=true``). A bad config exits with status 2 and one
message naming the field, the value and the fix.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Sequence

EXIT_CONFIG = 2


def load(overrides: Sequence[str]):
    """Compose + validate: (cfg as a plain dict, topology). Raises ValueError subclasses."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ldt.config import ConfigError
    from ldt.hydra_app import compose
    from ldt.validate import validate

    try:
        cfg = compose(list(overrides))
        world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
        topo = validate(cfg.cluster, cfg.model, world_size=world, train=cfg.train)
        plain = OmegaConf.to_container(cfg, resolve=True)
        path = plain["data"]["path"]
        if path and not os.path.isfile(path):
            raise ConfigError(f"data.path={path!r} is not a file; give a text file or leave "
                              "data.path unset for the built-in corpus")
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc}".strip()) from None
    return plain, topo


def main(argv: Sequence[str] | None = None) -> int:
    import ldt.quiet  # noqa: F401  (before megatron-core is imported)
    from hydra.errors import HydraException

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, topo = load(args)
    except (ValueError, HydraException) as exc:
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None else ""
        print(f"ldt: invalid config{where}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if "RANK" in os.environ:
        return _join_torchrun(cfg)
    return _launch_local(cfg, topo)


def _save_config(cfg: dict, run_dir: str) -> None:
    from omegaconf import OmegaConf

    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(OmegaConf.create(cfg), os.path.join(run_dir, "config.yaml"))


def _launch_local(cfg: dict, topo) -> int:
    """Bare launch: start the whole world here; every child is reaped whatever happens."""
    from ldt.launch import WorldError, run_local_world
    from ldt.training.checkpoint_files import CheckpointError
    from ldt.training.loop import reference_config, train_worker

    run_dir = os.path.abspath(cfg["run_dir"])
    try:
        _check_resume(cfg, hashes=True)
    except CheckpointError as exc:
        print(f"ldt: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    _save_config(cfg, run_dir)
    timeout = cfg["train"]["comm_timeout_s"]
    try:
        results = run_local_world(topo.world_size, train_worker,
                                  (cfg, run_dir, bool(cfg["train"]["resume"])),
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
                 *zip(summary.get("eval_losses", []), ref.get("eval_losses", []))]
        summary["parity_max_abs_diff"] = max(abs(a - b) for a, b in pairs)
    print(_summary_line(summary))
    return 0


def _check_resume(cfg: dict, hashes: bool) -> None:
    """``train.resume`` checked before any rank starts (files, model, steps left)."""
    if cfg["train"]["resume"]:
        from ldt.training.checkpoint_files import preflight

        preflight(cfg["train"]["resume"], cfg["model"], cfg["train"]["steps"], hashes=hashes)


def _stopped_early(exc, run_dir: str) -> int:
    """A stop signal ended the world before the ranks reached a step boundary."""
    import signal

    from ldt.training.checkpoint_files import latest

    name = signal.Signals(exc.stopped_by).name
    last = latest(run_dir)
    print(f"ldt: stopped by {name} before a step boundary ({exc.message.splitlines()[0]}); "
          f"the last complete checkpoint is {last or 'none'}", file=sys.stderr)
    return 128 + exc.stopped_by


def _summary_line(summary: dict) -> str:
    from ldt.training.outputs import summary_json

    return summary_json(_public(summary))


def _join_torchrun(cfg: dict) -> int:
    """Under torchrun: join its world; the loss stage's leader prints the summary."""
    import torch.distributed as dist

    from ldt.training.checkpoint_files import CheckpointError
    from ldt.training.loop import train_worker

    try:  # the same on every rank, before any collective (checksums: each rank, on load)
        _check_resume(cfg, hashes=False)
    except CheckpointError as exc:
        print(f"ldt: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    backend = _world_backend(cfg)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg["train"]["comm_timeout_s"]))
    holder = [os.path.abspath(cfg["run_dir"])]
    dist.broadcast_object_list(holder, src=0)  # one run folder, whatever each clock said
    if dist.get_rank() == 0:
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
    keys = ("steps", "first_step", "final_loss", "first_loss", "eval_loss", "tokens_per_s",
            "step_time_s", "parity_max_abs_diff", "run_dir")
    return {k: summary[k] for k in keys if k in summary}


if __name__ == "__main__":
    sys.exit(main())
