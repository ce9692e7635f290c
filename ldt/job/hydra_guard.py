"""What Hydra would write or print before ldt can check it (``run_app`` uses these).

Hydra makes the run folder and writes ``.hydra/`` into it, and with ``-m`` writes
``multirun.yaml`` into the sweep folder, before a job can look at either; its refusals of a
config file are tracebacks or several lines. So: :func:`take_output_subdir` turns Hydra's own
``.hydra/`` writing off and :func:`save_hydra_files` writes the same files once ``ldt-train``
has checked the folder is its own; :func:`sweep_folder_in_use` refuses a sweep folder that
holds an earlier run; :class:`HeldStderr` holds what Hydra prints until a job starts and
prints a refusal as one line (:func:`refusal_line`).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from omegaconf import DictConfig

from ldt.config.errors import ConfigError
from ldt.launch.lifetime import say_stop
from ldt.storage.atomic import holds_anything
from ldt.storage.atomic import replace_file


def take_output_subdir(args: list[str]) -> tuple[Optional[str], list[str]]:
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

    if not subdir:
        return
    hydra_cfg = HydraConfig.get()
    folder = os.path.join(hydra_cfg.runtime.output_dir, subdir)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"hydra.output_subdir={subdir}: cannot make {folder} "
                          f"({exc.strerror}); give a folder name inside the run folder "
                          "(default .hydra) or null") from None
    record = OmegaConf.to_container(hydra_cfg)
    record["output_subdir"] = subdir  # as the user set it (ldt turned Hydra's writing off)
    record["overrides"]["hydra"] = [o for o in record["overrides"]["hydra"]
                                    if o != "hydra.output_subdir=null"]
    if subdir != ".hydra":
        record["overrides"]["hydra"].append(f"hydra.output_subdir={subdir}")
    for name, node in (("config.yaml", cfg), ("hydra.yaml", OmegaConf.create({"hydra": record})),
                       ("overrides.yaml", hydra_cfg.overrides.task)):
        replace_file(os.path.join(folder, name), OmegaConf.to_yaml(node))


class HeldStderr:
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
            say_stop(f"ldt: invalid config: {refusal_line(text)}", self.real)

    def close(self) -> None:
        """Never the real stream's: a logging handler made while this stood in for stderr
        (absl's, on megatron-core's import) closes it when logging is configured again."""

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
        keep.append("remove the key or fix its spelling (every key: ldt/config/schema.py)")
    return "; ".join(keep)


def sweep_folder_in_use(args: Sequence[str]) -> Optional[str]:
    """With ``-m``, Hydra writes ``multirun.yaml`` into the sweep folder before any job can
    look at it: a sweep folder given on the command line (``hydra.sweep.dir=`` or
    ``run_dir=``) that already holds anything is refused here, in one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

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
