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
import shlex
import signal
import sys
from typing import Optional, Sequence

from ldt.config import LdtConfig
from ldt.config.errors import one_line
from ldt.config.errors import EXIT_CONFIG
from ldt.job.elastic import elastic_job
from ldt.job.hydra import run_app
from ldt.job.prepare import (build_extensions, check, check_run_dir_given, discard_run_folder,
                             join_torchrun, memory_check, new_run_folder, reference_config,
                             resolve, save_config, summary_line)
from ldt.launch import drill
from ldt.launch.lifetime import say_stop, stop_with_torchrun_agent
from ldt.launch.local import WorldError, run_local_world, start_forkserver_early
from ldt.schedule.zerobubble import Priced
from ldt.storage.atomic import check_run_folder
from ldt.storage.checkpoint_files import AUTO, latest, resume_auto
from ldt.storage.commit import _NO_SPACE, out_of_space
from ldt.storage.runlock import RunLock
from ldt.storage.snapshot_files import held
from ldt.training.outputs import parity_max_abs_diff


def main(argv: Sequence[str] | None = None) -> int:
    if stop_with_torchrun_agent():  # a worker of torchrun's agent never outlives it
        drill.arm()  # LDT_FAULT_AT: recovery drills kill this host at a point of a step
    code = run_app(_job, argv)  # a refusal or stop said its line (say_stop): torchrun's too
    if code and "RANK" in os.environ:
        # A failed torchrun rank has said why in one line. Its process groups may hold work
        # on a pair whose peer is gone, and their C++ destructors at interpreter exit can
        # then abort with a second stderr line ("terminate called without an active
        # exception": seen on a rank whose peer host was cut off): leave without them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _job(cfg, save_hydra_files=None) -> int:
    """One run (one job of a multirun): validate, say what starts, then launch or join.
    ``save_hydra_files``: writes Hydra's ``.hydra/`` (rank 0 only; see ``run_app``). The
    process that keeps the run folder (bare, or torchrun's rank 0) holds its lock for the
    run's life (:mod:`ldt.storage.runlock`), taken before anything is read or written there."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    if cfg.cluster.get("inventory"):  # elastic: the stages are planned from the nodes there
        return elastic_job(cfg, hydra_cfg, save_hydra_files)
    rank = int(os.environ["RANK"]) if "RANK" in os.environ else None
    out = hydra_cfg.runtime.output_dir
    lock = RunLock(out, _run_dir_flag(hydra_cfg))
    # a run folder this process made (Hydra, just now): a refusal removes it again
    fresh = save_hydra_files is not None and new_run_folder(out)

    def refused(code: int) -> int:
        lock.release()
        if fresh:
            discard_run_folder(out, hydra_cfg.runtime.cwd, ours=True)
        return code

    try:
        try:
            if save_hydra_files is not None:  # this process keeps the run folder
                lock.acquire()
            checked = _checked(cfg, hydra_cfg, rank, save_hydra_files)
        # ValueError: ConfigError, LayoutError (the config cannot work); OSError: a full disk
        # while .hydra/ is written, a file it cannot read
        except (ValueError, OSError) as exc:
            _say_refused(exc, out, rank)
            return refused(EXIT_CONFIG)
        if checked is None:  # nothing left to train
            return 0
        if not build_extensions(checked[0].cfg):  # before any process starts or group forms
            return refused(1)
        return _start(checked, hydra_cfg.runtime.choices, rank)
    except _Unwritable as exc:  # config.yaml, before the world starts
        say_stop(f"ldt: {_cannot_write(exc.__cause__, out)}")
        return refused(1)
    except WorldError as exc:  # a stop signal during the memory estimate's own world
        if not exc.stopped_by:
            raise
        say_stop(f"ldt: stopped by {signal.Signals(exc.stopped_by).name} before the run "
                 "started")
        return refused(128 + exc.stopped_by)
    finally:
        lock.release()


def _say_refused(exc: Exception, run_dir: str, rank: Optional[int]) -> None:
    """One line on stderr for a launch refused before training (the memory check's refusal
    has said its own)."""
    if isinstance(exc, OSError):
        say_stop(f"ldt: {_cannot_write(exc, run_dir)}")
    elif not isinstance(exc, _Refused):
        where = f" (rank {rank})" if rank is not None else ""
        say_stop(f"ldt: invalid config{where}: {one_line(exc)}")


def _start(checked, choices, rank: Optional[int]) -> int:
    """Say what starts, then join torchrun's world (``rank`` set) or start it here."""
    (config, topo, _, priced), memory, complete, auto = checked
    what = (f"cluster={choices.get('cluster')} model={choices.get('model')}: "
            f"{topo.num_stages} stages, TP {topo.tp_sizes}, dp {topo.dp}"
            + (", U-shape" if topo.u_shape else ""))
    if rank is not None:
        if rank == 0:
            print(f"ldt-train: {what}; joining torchrun's world of {topo.world_size} "
                  "processes", flush=True)
        return join_torchrun(config, topo, auto=auto, complete=complete, memory=memory,
                             priced=priced)
    print(f"ldt-train: {what}; starting {topo.world_size} processes on this machine\n"
          f"ldt-train: run folder {config.run_dir}\n{topo.rank_map()}{memory}", flush=True)
    return _launch_local(config, topo, priced)


def _cannot_write(exc: OSError, run_dir: str) -> str:
    """A run folder that cannot be written, as one line."""
    if out_of_space(exc, run_dir):
        return (f"run_dir {run_dir}: no space left on its device; the run did not start: free "
                "space there, or give a run_dir on another disk")
    name = str(exc.filename) if exc.filename else None
    if name is None or os.path.abspath(name).startswith(os.path.abspath(run_dir) + os.sep):
        return f"run_dir {run_dir}: cannot write {name or 'there'} ({exc.strerror or exc})"
    return f"cannot use {name} ({exc.strerror or exc}); check the path and its permissions"


def _checked(cfg, hydra_cfg, rank: Optional[int], save_hydra_files):
    """The config typed and validated (and ``.hydra/`` written once it is): ``(Checked, the
    memory estimate's text, train.resume=auto's "nothing left" line, whether train.resume is
    auto)``, or None when a bare launch has nothing left to train; raises
    ValueError for a config that cannot work."""
    auto = cfg.train.get("resume") == AUTO
    if auto:
        check_run_dir_given(hydra_cfg)
    plain, checked = prepare(cfg, hydra_cfg.runtime.output_dir, rank)
    config, topo, warnings = checked.cfg, checked.topo, checked.warnings
    complete = plain.pop("run_complete", None)
    if complete and rank is None:
        print(f"ldt-train: {complete}", flush=True)
        return None
    if save_hydra_files is not None:  # the folder that keeps the run's files
        check_run_folder(config.run_dir, _resuming(config, auto))
    if rank is None:  # a bare launch: its worlds' ranks fork from the forkserver
        start_forkserver_early()
    for warning in warnings:
        print(f"ldt: warning: {warning}", file=sys.stderr)
    memory = memory_check(plain, topo, rank)  # before .hydra/: a refusal leaves no folder
    if memory is None:
        raise _Refused()
    if save_hydra_files is not None:
        save_hydra_files()
    return checked, memory, complete, auto


class _Unwritable(Exception):
    """The run folder could not take config.yaml (its cause: the OSError)."""


class _Refused(ValueError):
    """A refusal already printed (the memory check's): exit 2 without another line."""


def _run_dir_flag(hydra_cfg) -> str:
    """How the user named the run folder: ``run_dir`` or ``hydra.run.dir``."""
    return "hydra.run.dir" if any(o.startswith("hydra.run.dir=")
                                  for o in hydra_cfg.overrides.hydra) else "run_dir"


def _resuming(config, auto: bool) -> Optional[str]:
    """What the run continues, for the run-folder check: train.resume, or with auto (even
    when it found no checkpoint yet) the run folder itself, which is then the run's own."""
    return config.train.resume or (config.run_dir if auto else None)


def prepare(cfg, run_dir: str, rank: Optional[int] = None):
    """The composed config resolved (run folder and paths made absolute), typed and validated:
    ``(the plain dict, its :class:`~ldt.job.prepare.Checked`)``; raises ConfigError. Imports neither torch nor megatron.
    ``train.resume=auto`` is resolved where the run folder is known (bare, torchrun's rank 0;
    the others learn it from rank 0); ``cfg["run_complete"]`` then says when nothing is left."""
    plain = resolve(cfg, run_dir)
    if plain["train"].get("resume") == AUTO:
        if rank in (None, 0):
            plain["run_complete"] = resume_auto(  # snapshots here: this run's own folder
                plain["train"], plain["run_dir"],
                restarted=held(plain["train"].get("snapshot_dir"), plain["run_dir"]))
        else:  # torchrun's other ranks learn it from rank 0 (join_torchrun)
            plain["train"]["resume"] = None
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    return plain, check(plain, rank, world)


def _launch_local(cfg: LdtConfig, topo, priced: Optional[Priced]) -> int:
    """Bare launch: start the whole world here; every child is reaped whatever happens. The
    ranks receive the typed config, the topology and the zero-bubble order's prices this
    process checked."""

    run_dir = cfg.run_dir
    try:
        save_config(cfg, run_dir)
    except OSError as exc:
        raise _Unwritable() from exc
    timeout = cfg.train.comm_timeout_s
    # prepare() (check_files with every rank local) checked the checkpoint's checksums
    verified = bool(cfg.train.resume or cfg.train.load)
    try:
        results = run_local_world(topo.world_size, _rank,
                                  (cfg, run_dir, verified, None, topo, priced),
                                  timeout_s=None, comm_timeout_s=timeout,
                                  stop_grace_s=max(120.0, 2 * timeout))
    except WorldError as exc:
        if exc.stopped_by:
            return _stopped_early(exc, run_dir)
        say_stop(f"ldt: training failed: {_describe(exc, topo, run_dir)}")
        return 1
    summary = next(r for r in results if r is not None)
    if summary.get("stopped"):
        say_stop(f"ldt: {summary['stopped'].message}")
        return summary["stopped"].exit_code
    if cfg.train.verify:
        ref = run_local_world(1, _rank, (reference_config(cfg),
                                                os.path.join(run_dir, "reference")),
                              timeout_s=None, comm_timeout_s=timeout)[0]
        try:
            summary["parity_max_abs_diff"] = parity_max_abs_diff(summary, ref)
        except ValueError as exc:
            say_stop(f"ldt: {exc}")
            print(summary_line(summary))
            return 1
    print(summary_line(summary))
    return 0


def _rank(rank: int, world: int, *args):
    """A bare launch's rank (:func:`ldt.training.loop.train_worker`). megatron-core is imported
    here, in the rank, never in the launcher: its import takes seconds and the launcher only
    waits for the ranks."""
    from ldt.training.loop import train_worker

    return train_worker(rank, world, *args)


def _stopped_early(exc, run_dir: str) -> int:
    """A stop signal ended the world before the ranks reached a step boundary."""
    name = signal.Signals(exc.stopped_by).name
    last = latest(run_dir)
    say_stop(f"ldt: stopped by {name} before a step boundary ({exc.message.splitlines()[0]}); "
             f"the last complete checkpoint is {last or 'none'}")
    return 128 + exc.stopped_by


def _describe(exc, topo, run_dir: str = "") -> str:
    if exc.rank is None:
        return str(exc)
    from ldt.training.failure import rank_label  # imports torch: the world has run

    last = exc.tb.strip().splitlines()[-1] if exc.tb.strip() else ""
    if any(words in last for words in _NO_SPACE):  # the run folder's disk filled up
        found = latest(run_dir) if run_dir else None
        resume = (f"the last complete checkpoint, {found}, is intact: free space and resume "
                  f"with {shlex.quote(f'train.resume={run_dir}')}" if found
                  else "no checkpoint was written: free space and run it again")
        return (f"{rank_label(topo, exc.rank)}: no space left on the device of the run folder "
                f"{run_dir} ({last}); {resume}")
    where = rank_label(topo, exc.rank)
    if exc.stalled:  # "rank N stopped making progress: ...": the others waited for it
        return str(exc).replace(f"rank {exc.rank} ", f"{where} ", 1)
    return f"{where} failed first: {exc}"


if __name__ == "__main__":
    sys.exit(main())
