"""The one loader of typed YAML: a file, a dict or an OmegaConf node onto a dataclass schema.

Every typed config ldt reads goes through :func:`typed` (a dict from a test or the API, a
Hydra node) or :func:`load_typed` (a file: a user's, ``ldt-plan``'s, or a shipped
``conf/<group>/<name>.yaml`` found by :func:`conf_path`): the cluster, the model, the
inventory. A key the schema lacks is refused naming where it is (``cluster.stages[1].colour``)
and the closest field; a wrong type names the key. The schemas themselves live in
:mod:`ldt.config` (ldt's config groups) and :mod:`ldt.plan.inventory` (the planner's input).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import typing
from typing import Any, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ldt.config.errors import ConfigError
from ldt.config.userfiles import load_yaml


def plain(obj: Any) -> Any:
    """A plain container; drops Hydra's ``defaults`` list so a conf/ file also loads bare."""
    if OmegaConf.is_config(obj):
        obj = OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, dict) and "defaults" in obj:
        obj = {k: v for k, v in obj.items() if k != "defaults"}
    return obj


def fields_file(schema: type) -> str:
    """Where a schema's fields are written down (``ldt/config/schema.py``), for error messages."""
    return schema.__module__.replace(".", "/") + ".py"


def typed(schema: type, obj: Any, group: str, source: str = "", ref: str = "") -> Any:
    """``obj`` merged onto ``schema``, built as the dataclass (its ``__post_init__`` checks
    run); a key the schema lacks or a value of the wrong type is a :class:`ConfigError` naming
    ``group.key`` (and ``source``, the file it came from). ``ref``: where the fields are listed
    (default: the schema's module)."""
    obj, where = plain(obj), f" in {source}" if source else ""
    ref = ref or fields_file(schema)
    unknown = _unknown_field(obj, schema, group)
    if unknown is not None:
        key, owner, name = unknown
        names = [f.name for f in dataclasses.fields(owner)]
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f", or did you mean {close[0]!r}?" if close else f"; known: {', '.join(names)}"
        raise ConfigError(f"{key} is not a field of {owner.__name__}; remove it"
                          f"{' from ' + source if source else ''}{hint} (all fields: {ref})")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), obj))
    except OmegaConfBaseException as exc:  # omegaconf names the key; keep its first line
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{group}.{key}{where}: {str(exc).splitlines()[0]}; check it against "
                          f"the fields of {schema.__name__} ({ref})") from None


def config_dict(obj: Any) -> Any:
    """A typed config as plain data for a YAML or JSON file: every field that has a value
    (None, and a nested config left all None, are left out: they load back as the defaults)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        kept = {k: config_dict(v) for k, v in obj.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {}}
    if isinstance(obj, (list, tuple)):
        return [config_dict(v) for v in obj]
    return obj


def _dataclass_of(kind: Any) -> Optional[type]:
    """The dataclass a field holds (``X``, ``Optional[X]``), else None."""
    if typing.get_origin(kind) is typing.Union:
        kinds = [k for k in typing.get_args(kind) if k is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else None
    return kind if dataclasses.is_dataclass(kind) and isinstance(kind, type) else None


def _unknown_field(obj: Any, schema: type, where: str) -> Optional[tuple[str, type, str]]:
    """The first key of ``obj`` (a plain dict, at any depth) that ``schema`` lacks:
    (dotted place, the dataclass that lacks it, the key)."""
    if not isinstance(obj, dict):
        return None
    hints = typing.get_type_hints(schema)
    for key, value in obj.items():
        if key not in hints:
            return f"{where}.{key}", schema, key
        kind = hints[key]
        if typing.get_origin(kind) in (list, List) and isinstance(value, list):
            item = _dataclass_of(typing.get_args(kind)[0])
            found = next((f for i, v in enumerate(value) if item is not None
                          for f in [_unknown_field(v, item, f"{where}.{key}[{i}]")] if f), None)
        else:
            inner = _dataclass_of(kind)
            found = _unknown_field(value, inner, f"{where}.{key}") if inner else None
        if found:
            return found
    return None


def conf_dir() -> str:
    """The installed ``conf/`` tree (Hydra's config groups, shipped inventories)."""
    return str(importlib.resources.files("ldt.conf"))


def conf_path(name_or_path: str, group: str) -> str:
    """A path as given, or ``conf/<group>/<name>.yaml`` from the installed config tree."""
    if os.path.exists(name_or_path):
        return name_or_path
    path = os.path.join(conf_dir(), group, f"{name_or_path}.yaml")
    if not os.path.exists(path):
        shipped = sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir(), group))
                         if f.endswith(".yaml"))
        raise ConfigError(f"{group} {name_or_path!r} is neither a file nor a shipped config; "
                          f"give a path or one of {shipped}")
    return path


def load_plain(path: str, what: str = "YAML file") -> dict:
    """A YAML file as a plain dict, interpolations resolved, Hydra's ``defaults`` dropped."""
    try:
        return plain(OmegaConf.to_container(load_yaml(path, what), resolve=True))
    except OmegaConfBaseException as exc:  # an interpolation that does not resolve
        raise ConfigError(f"{what} {path}: {str(exc).splitlines()[0]}") from None


def load_typed(schema: type, path: str, group: str, what: str = "YAML file",
               ref: str = "") -> Any:
    """A YAML file as ``schema`` (see :func:`typed`); errors name the file."""
    return typed(schema, load_plain(path, what), group, path, ref)


def load_group(schema: type, name_or_path: str, group: str, what: str = "YAML file") -> Any:
    """A file, or the shipped ``conf/<group>/<name>.yaml``, as ``schema``."""
    return load_typed(schema, conf_path(name_or_path, group), group, what)


def unknown_key(root: type, key: str, value: str = "", ref: str = "") -> Optional[str]:
    """Why the dotted ``key`` (a command-line override's, e.g. ``train.stepz``, with its
    ``value``) is not in the schema ``root``, naming the closest key that is, in one line; None
    when it is (or lies below a field that takes any key: a dict, ``Any``)."""
    parts, owner, prefix = key.split("."), root, ""
    while parts:
        name = parts.pop(0)
        hints = typing.get_type_hints(owner)
        if name not in hints:  # the closest name at this level, or anywhere from the top
            rest = "".join("." + p for p in parts)
            close = [prefix + c + rest for c in difflib.get_close_matches(name, list(hints), n=1)]
            if not prefix:
                close = difflib.get_close_matches(key, [*hints, *schema_keys(root)], n=1)
            given = f"{key}={value}: " if value else ""
            fix = (f"did you mean {close[0]}{'=' + value if value else ''}?" if close
                   else f"the keys of {prefix[:-1] or 'the config'}: {', '.join(hints)}")
            return (f"{given}{key} is not a config key; {fix} (every key: "
                    f"{ref or fields_file(root)})")
        prefix += name + "."
        kind = hints[name]
        if typing.get_origin(kind) in (list, List) and parts and parts[0].isdigit():
            prefix += parts.pop(0) + "."
            kind = typing.get_args(kind)[0]
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            return None  # a value (or a dict / Any): whatever lies below is its business
        owner = kind
    return None


def schema_keys(owner: type, prefix: str = "") -> list[str]:
    """Every dotted key of a schema (a list of dataclasses as ``stages.0.*``)."""
    out = []
    for name, kind in typing.get_type_hints(owner).items():
        path = prefix + name
        if typing.get_origin(kind) in (list, List):
            kind, path = typing.get_args(kind)[0], path + ".0"
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out += schema_keys(kind, path + ".")
        else:
            out.append(path)
    return out
