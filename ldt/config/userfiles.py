"""Reading the YAML and JSON files a user hands to ldt, with one-line errors.

A file that is missing, unreadable or not valid YAML / JSON is a :class:`ConfigError` naming
the file, the line and the column of the problem and the fix, never a parser's traceback.
Everything that reads a user's YAML or JSON (cluster and inventory files, model files, a
Hugging Face ``config.json``, checkpoint metadata) goes through here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from ldt.config.errors import ConfigError


def _where(path: str, line: int, column: int) -> str:
    return f"{path}:{line}:{column}"


def path_kind(path: str) -> str:
    """What is at ``path``: ``"file"``, ``"folder"``, ``"missing"``, ``"broken link"``,
    ``"special"`` (a device, a pipe or a socket: ``/dev/null`` is not an empty file to read)
    or ``"unreadable"``."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "broken link" if os.path.islink(path) else "missing"
    except OSError:
        return "unreadable"
    if stat.S_ISDIR(mode):
        return "folder"
    return "file" if stat.S_ISREG(mode) else "special"


_IS = {"missing": ": no such file or folder", "folder": " is a folder",
       "broken link": " is a broken link", "unreadable": " cannot be looked at (permissions?)",
       "special": " is not a regular file or folder (a device, a pipe or a socket)"}


def not_a(path: str, named: str, want: str, fix: str) -> Optional[str]:
    """The refusal of ``path`` (as the user ``named`` it, e.g. ``--input data``) when it is
    not a ``want`` (``"file"`` or ``"folder"``): a folder is called a folder and
    ``/dev/null`` a device, never "no such file"; None when it is one (and readable)."""
    kind = path_kind(path)
    if kind == want:
        if not os.access(path, os.R_OK | (os.X_OK if want == "folder" else 0)):
            return f"{named} is not readable; check its permissions"
        return None
    also = f", not a {want}" if kind in ("folder", "file") else ""
    return f"{named}{_IS.get(kind, ' is a file')}{also}; {fix}"


def require(path: str, named: str, want: str, fix: str) -> None:
    """:func:`not_a` as a :class:`ConfigError`."""
    why = not_a(path, named, want, fix)
    if why:
        raise ConfigError(why)


def read_text(path: str, what: str) -> str:
    """The file's text; a missing, unreadable or non-UTF-8 file, a folder, a device or a pipe
    (which would never end or block) is one line."""
    if path_kind(path) in ("special", "broken link"):
        raise ConfigError(not_a(path, f"{what} {path}", "file", "give the file"))
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: no such file; check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder; give the file") from None
    except PermissionError:
        raise ConfigError(f"{what} {path} is not readable; check its permissions") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: not UTF-8 text (byte {exc.start}); give a text "
                          "file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None


def load_yaml(path: str, what: str = "YAML file") -> Any:
    """An OmegaConf node of a YAML file (interpolations kept, as ``OmegaConf.load``)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    text = read_text(path, what)
    try:
        data = yaml.safe_load(text)  # the syntax, and what kind of document it is
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        at = _where(path, mark.line + 1, mark.column + 1) if mark is not None else path
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{what} {at}: invalid YAML ({problem}); fix the syntax there "
                          "(a missing ',' or ':', unclosed brackets or quotes, tabs)") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{what} {path} holds a {type(data).__name__}, not a mapping of keys "
                          "to values; write it as 'key: value' lines")
    try:
        return OmegaConf.create(text) if data else OmegaConf.create({})
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"{what} {path}: {str(exc).splitlines()[0]}") from None


def load_json(path: str, what: str = "JSON file") -> Any:
    """The parsed JSON of a file."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {_where(path, exc.lineno, exc.colno)}: invalid JSON "
                          f"({exc.msg}); fix the file there or restore it from a copy") from None


def load_json_object(path: str, what: str = "JSON file") -> dict:
    """A JSON file that must hold an object."""
    data = load_json(path, what)
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} holds a {type(data).__name__}, not a JSON object "
                          "({...}); restore it from a copy")
    return data
