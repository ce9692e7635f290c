"""A checkpoint's tensors without a world: for tools and checks that run in one process.

:func:`tensor_index` lists a complete checkpoint's tensors from its metadata files alone,
:func:`read_tensors` reads some of them in full, :func:`check_compatible` refuses a checkpoint
that does not fit a model config (metadata only: the launcher runs it before any process
starts), and :func:`write_tensors` / :func:`mark_complete` write a checkpoint from full tensors
(``ldt-convert``'s import) in the same format, with the same checksums, as a training run's
collective save (:mod:`ldt.training.checkpoint`). The folder format itself is
:mod:`ldt.storage.checkpoint_files`'s.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

from ldt.config import ConfigError
from ldt.models.arch import check_arch, check_shapes, read_model_json
from ldt.storage import checkpoint_files as files
from ldt.storage.checkpoint_files import COMPLETE, latest


def write_tensors(target: str, part: int, tensors: dict, step: int,
                  optim: Optional[dict] = None) -> str:
    """Write ``target/stage_<part>``: full tensors under global names (and their optimizer state),
    atomically and with checksums (:func:`ldt.storage.checkpoint_files.write_part`; raises
    its DiskFullError). Loads read every ``stage_*`` folder, so a writer may split a model
    into any number of parts."""
    return files.write_part(target, f"stage_{part}",
                            {"model": tensors, "optim": optim or {}, "step": step})


def mark_complete(target: str, step: int) -> None:
    """Seal ``target`` (checksums of its top-level files, then COMPLETE), written last: from
    now on the checkpoint may be loaded."""
    files.seal(target, {"step": step})


def tensor_index(path: str) -> dict:
    """Name -> (stage folder, storage metadata: size, dtype) of every model tensor of a
    complete checkpoint, from the metadata files alone (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"{path!r} holds no complete checkpoint (no {COMPLETE} marker)")
    out = {}
    for stage_dir in files.parts(found):
        folder = os.path.join(found, stage_dir)
        try:
            metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
        except Exception:  # a damaged .metadata: name the file if its checksum says so
            files.verify(found, which=[stage_dir])
            raise
        for key, meta in metadata.items():
            if key.startswith("model."):
                out.setdefault(key[len("model."):], (folder, meta))
    return out


def read_tensors(index: dict, names) -> dict:
    """Full tensors ``names`` (stored dtype) from a :func:`tensor_index`, one folder at a time."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    by_folder: dict = {}
    for n in names:
        by_folder.setdefault(index[n][0], []).append(n)
    out = {}
    for folder, group in by_folder.items():
        sd = {"model": {n: torch.empty(index[n][1].size, dtype=index[n][1].properties.dtype)
                        for n in group}}
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(sd, storage_reader=FileSystemReader(folder),
                     planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        out.update(sd["model"])
    return out


def check_compatible(path: str, model) -> None:
    """Refuse a checkpoint whose architecture or tensor shapes do not fit ``model`` (a
    ConfigError naming the field or the parameter); reads metadata only, no collective."""
    found = latest(path)
    if found is None:
        raise ConfigError(f"{path!r} holds no complete checkpoint (no {COMPLETE} marker); give "
                          "a run folder with checkpoints/, a checkpoints/step_N folder or an "
                          "ldt-convert output folder")
    saved = read_model_json(found)
    if saved is not None:
        check_arch(saved, model, found)
    check_shapes({n: tuple(meta.size) for n, (_, meta) in tensor_index(found).items()}, model,
                 found)
