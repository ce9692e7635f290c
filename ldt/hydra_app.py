"""Hydra plumbing: the ``conf/`` tree ships inside the package as ``ldt.conf``.

:func:`run_app` turns a task function into a Hydra application with Hydra's own command line
(``--help``, ``--cfg job``, ``--info``, ``-m``, ``--config-dir``, ``--config-name``,
``hydra.run.dir=...``): ``ldt-train`` and ``python -m ldt.topology`` are built with it.
:func:`compose` gives the same config without an application (for the API and tests).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from ldt.config import register_configs

CONFIG_MODULE = "ldt.conf"
CONFIG_NAME = "config"
EXIT_CONFIG = 2
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

    ``run_folder=False`` is for apps that write nothing (``python -m ldt.topology``): Hydra's
    folders then go to a temporary directory that is removed afterwards.

    ``task(cfg)`` runs once per job (once, or once per multirun job, one after another) and
    returns that job's status; the app's status is the first non-zero one. When Hydra itself
    refuses the command line before any job starts (an unknown group option, a key that is not
    in the schema, bad override syntax) the status is 2, like any other config ldt refuses.

    Under torchrun (``RANK`` set) only rank 0 keeps Hydra's run folder and ``.hydra/``; the
    other ranks write nothing there and learn the folder from rank 0 (the task does that once
    the world is up), so clocks that differ across nodes cannot split a run in two.
    """
    import hydra

    register_configs()
    args = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("RANK", "0") != "0":
        if any(a in ("-m", "--multirun") for a in args):
            print("ldt: --multirun under torchrun is not supported; launch torchrun once per job",
                  file=sys.stderr)
            return EXIT_CONFIG
        args += ["hydra.output_subdir=null", "hydra.run.dir=."]
    if run_folder and any(a in ("-m", "--multirun") for a in args):
        refused = _sweep_folder_in_use(args)
        if refused:
            print(f"ldt: invalid config: {refused}", file=sys.stderr)
            return EXIT_CONFIG
    hydra_subdir = None
    if run_folder and os.environ.get("RANK", "0") == "0":
        # Hydra writes .hydra/ into the run folder before the job can look at it; the job
        # writes it itself (``save_hydra_files``) once it knows the folder is its own
        hydra_subdir, args = _take_output_subdir(args)
    scratch = None
    if not run_folder:
        import tempfile

        scratch = tempfile.mkdtemp(prefix="ldt-hydra-")
        args += [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}",
                 "hydra.output_subdir=null"]
    codes: list[int] = []

    held = _HeldStderr(sys.stderr)  # Hydra's refusals, one line; the job's output streams

    @functools.wraps(task)  # Hydra names the job after the task's module
    def job(cfg: DictConfig) -> int:
        codes.append(1)  # started; an exception leaves it failed (Hydra reports it, exit 1)
        held.release()
        if hydra_subdir is None:
            codes[-1] = int(task(cfg) or 0)
        else:
            codes[-1] = int(task(cfg, functools.partial(save_hydra_files, cfg, hydra_subdir))
                            or 0)
        return codes[-1]

    app = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME,
                     version_base="1.3")(job)
    saved, sys.argv = sys.argv, [sys.argv[0], *args]
    sys.stderr = held
    try:
        app()
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
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    return next((c for c in codes if c), 0)


def _take_output_subdir(args: list[str]) -> tuple[Optional[str], list[str]]:
    """The ``hydra.output_subdir`` the user asked for ('.hydra' unless given; '' for none),
    and the arguments with Hydra's own writing of it turned off."""
    subdir = ".hydra"
    rest = []
    for a in args:
        key, _, value = a.partition("=")
        if key.lstrip("+~") == "hydra.output_subdir":
            subdir = "" if value in ("null", "None", "") else value
        else:
            rest.append(a)
    return subdir, _with_override(rest, "hydra.output_subdir=null")


def _with_override(args: list[str], override: str) -> list[str]:
    """``args`` plus one override, placed where Hydra's parser takes it: its overrides are
    one run of positional arguments (``--cfg job a=1`` or ``a=1 --cfg job``, not both)."""
    import argparse
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            given = get_args_parser().parse_args(args).overrides
    except (SystemExit, argparse.ArgumentError):  # Hydra will refuse the line itself
        return [*args, override]
    for i in range(len(args) - len(given) + 1):
        if given and args[i:i + len(given)] == given:
            return [*args[:i + len(given)], override, *args[i + len(given):]]
    return [override, *args]


def save_hydra_files(cfg: DictConfig, subdir: str) -> None:
    """Hydra's record of a job (the task config, Hydra's config, the overrides), written the
    way Hydra writes it, each file whole (:func:`ldt.storage.atomic.replace_file`)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from ldt.storage.atomic import replace_file

    if not subdir:
        return
    hydra_cfg = HydraConfig.get()
    folder = os.path.join(hydra_cfg.runtime.output_dir, subdir)
    os.makedirs(folder, exist_ok=True)
    whole = OmegaConf.create({"hydra": OmegaConf.to_container(hydra_cfg)})
    with_output_subdir = OmegaConf.merge(whole, {"hydra": {"output_subdir": subdir}})
    for name, node in (("config.yaml", cfg), ("hydra.yaml", with_output_subdir),
                       ("overrides.yaml", hydra_cfg.overrides.task)):
        replace_file(os.path.join(folder, name), OmegaConf.to_yaml(node))


class _HeldStderr:
    """stderr while Hydra composes: what it prints is held until a job starts (then it all
    goes out, and the job's output streams as usual); when Hydra refuses the configuration
    instead (a YAML syntax error in a config file, a key a file's schema lacks, a missing
    option), :meth:`refused` prints it as one line, without Hydra's traceback."""

    def __init__(self, real):
        self.real, self._held, self._passing = real, [], False

    def write(self, text: str) -> int:
        if self._passing:
            return self.real.write(text)
        self._held.append(text)
        return len(text)

    def flush(self) -> None:
        if self._passing:
            self.real.flush()

    def release(self) -> None:
        if not self._passing:
            self._passing = True
            self.real.write("".join(self._held))
            self._held = []

    def refused(self) -> None:
        self._passing = True
        text, self._held = "".join(self._held), []
        if text.strip():
            print(f"ldt: invalid config: {refusal_line(text)}", file=self.real)

    def __getattr__(self, name):  # fileno, isatty, encoding...: the real stream's
        return getattr(self.real, name)


def refusal_line(text: str) -> str:
    """Hydra's refusal (possibly a traceback, several lines) as one line naming the file,
    the line and the column where it can."""
    import re

    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if any(ln.startswith("Traceback") for ln in lines):  # keep the exception, not the frames
        last = max(i for i, ln in enumerate(lines) if ln.lstrip().startswith("File ")
                   or ln.startswith("Traceback"))
        lines = [ln for ln in lines[last + 1:] if not ln.startswith(" " * 4)]
    exists = [m for ln in lines for m in [re.search(r"FileExistsError: .*File exists: '(.+)'",
                                                     ln)] if m]
    if exists:  # Hydra could not make the run folder
        return (f"hydra.run.dir={exists[0].group(1)} exists and is not a folder; give a new "
                "run_dir")
    marks = [m for ln in lines for m in [re.search(r'in "(.+)", line (\d+), column (\d+)', ln)]
             if m]
    if marks and any("yaml" in ln.lower() for ln in lines):
        path, line, column = marks[-1].groups()
        problem = [ln for ln in lines if not ln.strip().startswith("in \"")][-1]
        problem = problem.split(": ", 1)[-1] if problem.startswith("yaml.") else problem
        return (f"{path}:{line}:{column}: invalid YAML ({problem.strip()}); fix the syntax "
                "there (a missing ',' or ':', unclosed brackets or quotes, tabs)")
    lines = [re.sub(r"^(ldt\.[\w.]+\.)?\w*(Error|Exception): ", "", ln) for ln in lines]
    keep = []
    for ln in lines:
        if ln.startswith(("Config search path", "Set the environment variable HYDRA_FULL_ERROR",
                          "    full_key", "    reference_type", "    object_type")):
            if ln.startswith("Config search path"):
                break
            continue
        keep.append(ln.strip().rstrip(":") if ln.strip().endswith(":") else ln.strip())
    if any("not in '" in ln and "Key '" in ln for ln in keep):
        keep.append("remove the key or fix its spelling (every key: ldt/config.py)")
    return "; ".join(keep)



def _sweep_folder_in_use(args: Sequence[str]) -> Optional[str]:
    """With ``-m``, Hydra writes ``multirun.yaml`` into the sweep folder before any job can
    look at it: a sweep folder given on the command line (``hydra.sweep.dir=`` or
    ``run_dir=``) that already holds anything is refused here, in one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from ldt.storage.atomic import holds_anything

    given = {}
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = OverridesParser.create().parse_overrides([arg])[0]
        except HydraException:
            continue  # Hydra refuses it itself
        if override.key_or_group in ("hydra.sweep.dir", "run_dir") \
                and not override.is_sweep_override():
            given[override.key_or_group] = override.value()
    folder = given.get("hydra.sweep.dir", given.get("run_dir"))
    if not isinstance(folder, str) or "${" in folder or not holds_anything(folder):
        return None
    key = "hydra.sweep.dir" if "hydra.sweep.dir" in given else "run_dir"
    return (f"{key}={folder} already holds files; a sweep (-m) never writes into another run's "
            f"folder: give a new {key}")
