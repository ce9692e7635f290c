"""Hydra plumbing: the ``conf/`` tree ships inside the package as ``ldt.conf``.

:func:`run_app` turns a task function into a Hydra application with Hydra's own command line
(``--help``, ``--cfg job``, ``--info``, ``-m``, ``--config-dir``, ``--config-name``,
``hydra.run.dir=...``): ``ldt-train`` and ``ldt-rankmap`` are built with it.
:func:`compose` gives the same config without an application (for the API and tests).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import tempfile
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from ldt.config import register_configs, unknown_key
from ldt.config.errors import EXIT_CONFIG
from ldt.launch.lifetime import say_stop
from ldt.job.hydra_guard import HeldStderr, save_hydra_files, sweep_folder_in_use, take_output_subdir

CONFIG_MODULE = "ldt.conf"
CONFIG_NAME = "config"
"""Exit status of a config (or command line) that cannot work."""


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed, type-checked config (same result as the Hydra app, without a run folder)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))


def run_app(task: Callable[..., int], argv: Optional[Sequence[str]] = None, *,
            run_folder: bool = True) -> int:
    """Run ``task`` as a Hydra app over ``conf/`` and return the process exit status.

    With ``run_folder`` (``ldt-train``) Hydra makes the run folder but writes nothing into it:
    the task is called as ``task(cfg, save_hydra_files)`` and calls ``save_hydra_files()``
    once it has checked the folder is its own (a run never writes into another run's folder,
    even its ``.hydra/``), which writes Hydra's ``config.yaml``, ``hydra.yaml`` and
    ``overrides.yaml`` into ``hydra.output_subdir`` (``.hydra``) as Hydra would have.

    ``run_folder=False`` is for apps that write nothing (``ldt-rankmap``): Hydra's
    folders then go to a temporary directory that is removed afterwards.

    ``task(cfg)`` runs once per job (once, or once per multirun job, one after another) and
    returns that job's status; the app's status is the first non-zero one. When Hydra itself
    refuses the command line before any job starts (an unknown group option, a key that is not
    in the schema, bad override syntax) the status is 2, like any other config ldt refuses.

    Under torchrun (``RANK`` set) only rank 0 keeps Hydra's run folder and ``.hydra/``; the
    other ranks write nothing there and learn the folder from rank 0 (the task does that once
    the world is up), so clocks that differ across nodes cannot split a run in two.
    """
    import hydra  # Hydra loads when an app runs: `import ldt` stays cheap

    register_configs()
    args = list(sys.argv[1:] if argv is None else argv)
    refused = _refused_command_line(args, run_folder)
    if refused:
        say_stop(f"ldt: {refused}")
        return EXIT_CONFIG
    args, hydra_subdir, scratch = _hydra_args(args, run_folder)
    codes: list[int] = []  # each job's status
    held = HeldStderr(sys.stderr)  # Hydra's refusals, one line; the job's output streams
    app = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME,
                     version_base="1.3")(_hydra_job(task, hydra_subdir, codes, held))
    saved, sys.argv = sys.argv, [sys.argv[0], *args]
    sys.stderr = held
    try:
        app()
    except _Stopped as stop:
        return stop.code
    except KeyboardInterrupt:  # Ctrl-C before a job's world started (it says its own)
        say_stop("ldt: interrupted (SIGINT)")
        return 128 + signal.SIGINT
    except SystemExit as exc:  # --help, --version, or Hydra refusing the command line
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 1 and not codes:
            held.refused()
            return EXIT_CONFIG
        return code
    finally:
        held.release()
        sys.stderr = held.real
        sys.argv = saved
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return next((c for c in codes if c), 0)


def _hydra_args(args: list[str], run_folder: bool):
    """``(args for Hydra, the .hydra/ folder the job writes itself or None, a scratch run
    folder to remove afterwards or None)``."""
    if os.environ.get("RANK", "0") != "0":  # rank 0 keeps the run folder
        args = [*args, "hydra.output_subdir=null", "hydra.run.dir=."]
    hydra_subdir = None
    if run_folder and os.environ.get("RANK", "0") == "0":
        # Hydra writes .hydra/ into the run folder before the job can look at it; the job
        # writes it itself (``save_hydra_files``) once it knows the folder is its own
        hydra_subdir, args = take_output_subdir(args)
    scratch = None if run_folder else tempfile.mkdtemp(prefix="ldt-hydra-")
    if scratch is not None:
        args = [*args, f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}",
                "hydra.output_subdir=null"]
    return args, hydra_subdir, scratch


def _refused_command_line(args: Sequence[str], run_folder: bool) -> Optional[str]:
    """Why ldt refuses the command line before Hydra sees it, as one line; None when it
    does not: -m under torchrun, a multirun's folder in use, a key not in the schema (Hydra's
    own refusal is eight lines and suggests a '+' that fails too)."""
    multirun = any(a in ("-m", "--multirun") for a in args)
    if multirun and os.environ.get("RANK", "0") != "0":
        return "--multirun under torchrun is not supported; launch torchrun once per job"
    refused = sweep_folder_in_use(args) if run_folder and multirun else None
    refused = refused or _unknown_key(args)
    return f"invalid config: {refused}" if refused else None


def _hydra_job(task: Callable[..., int], hydra_subdir: Optional[str], codes: list[int],
         held: HeldStderr) -> Callable[[DictConfig], int]:
    """The function Hydra calls once per job: runs ``task``, records its status in ``codes``."""

    @functools.wraps(task)  # Hydra names the job after the task's module
    def job(cfg: DictConfig) -> int:
        codes.append(1)  # started; an exception leaves it failed (Hydra reports it, exit 1)
        held.release()
        if hydra_subdir is None:
            codes[-1] = int(task(cfg) or 0)
        else:
            codes[-1] = int(task(cfg, functools.partial(save_hydra_files, cfg, hydra_subdir))
                            or 0)
        if codes[-1] in STOPPED:  # a multirun's later jobs do not start either
            raise _Stopped(codes[-1])
        return codes[-1]

    return job


STOPPED = {128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP}
"""A job's status when a stop signal ended it."""


class _Stopped(BaseException):
    """A job ended by a stop signal: the app stops (Hydra's launcher would start the next
    multirun job; it catches Exception only)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


_FLAGS_WITH_VALUE = ("-cd", "--config-dir", "-cn", "--config-name", "-cp", "--config-path",
                     "-c", "--cfg", "-p", "--package", "-i", "--info", "--experimental-rerun")


def _unknown_key(args: Sequence[str]) -> Optional[str]:
    """The first command-line override whose key is not in the schema, as one line naming it,
    its value and the closest key (:func:`ldt.config.unknown_key`); None when every key is.
    Group choices (``cluster=...``, ``train/optimizer=...``), ``hydra.*`` and deletions are
    Hydra's; an undotted key is left to Hydra too when a config folder of the user's may add
    groups. Overrides Hydra cannot parse are left for it to refuse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    user_groups = any(a.split("=")[0] in ("-cd", "--config-dir") or a.startswith("hydra.searchpath")
                      for a in args)
    for prev, arg in zip([None, *args], args):
        if arg.startswith("-") or "=" not in arg or prev in _FLAGS_WITH_VALUE:
            continue
        try:
            override = parser.parse_overrides([arg])[0]
        except HydraException:
            continue
        key = override.key_or_group
        if (override.is_delete() or override.package is not None or "/" in key
                or key.split(".")[0] == "hydra" or ("." not in key and user_groups)):
            continue
        why = unknown_key(key, arg.split("=", 1)[1])
        if why:
            return why
    return None
