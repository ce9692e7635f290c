"""Hugging Face folder <-> ldt checkpoint, one tensor at a time.

Import (:func:`import_hf`): ``config.json`` gives the family and the ModelConfig; the
safetensors files (one, or sharded with ``model.safetensors.index.json``) are opened lazily
with the ``safetensors`` package and read one tensor at a time, one part of the model at a
time (the embedding, each decoder layer, the final norm and head), each part written as one
``stage_<k>`` folder through :func:`ldt.models.tensor_files.write_tensors`. So the peak memory
is about one decoder layer, not the model. ``model.json`` records the architecture, the
source's ``config.json`` and tokenizer files are copied next to it (``data.tokenizer=<out>``
finds them), and COMPLETE is written last. The step recorded is -1: both ``train.load`` and
``train.resume`` start at step 0.

Export (:func:`export_hf`) reads an ldt checkpoint (an import, or any training checkpoint,
whatever its layout) part by part and writes sharded safetensors plus their index, a
``config.json`` built with ``transformers``' config class, and the tokenizer files. Every
tensor is checked against transformers' own model of that config, built as a skeleton without
weights (``accelerate.init_empty_weights``), before its file is written: a name or shape
transformers would not load is refused at export, not found later by the user.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from math import prod
from typing import Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ldt.config import ConfigError, ModelConfig, to_model
from ldt.config.userfiles import load_json_object, not_a
from ldt.models.arch import full_shapes, read_model_json, write_model_json
from ldt.models.hf.families import Family, family_of_hf, family_of_model
from ldt.models.tensor_files import mark_complete, read_tensors, tensor_index, write_tensors
from ldt.storage import checkpoint_files as files
from ldt.storage.atomic import check_output, new_folder
from ldt.storage.runlock import check_not_training

IMPORT_STEP = -1  # "before step 0": resume and load both start at step 0
HF_CONFIG = "hf_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


class SafetensorsFolder:
    """The tensors of a Hugging Face folder, by name, read lazily (one file open at a time).
    A damaged file (a truncated one, an index that names a missing file) is a ConfigError
    naming it; so is a tensor that holds NaN or Inf."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = load_json_object(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{index} has no 'weight_map' of tensor names to files; "
                                  "restore the file from the model's source")
            self.file_of = dict(weight_map)
        else:
            files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            if not files:
                raise ConfigError(f"{folder} has no *.safetensors file; ldt-convert reads "
                                  "safetensors (save the model with safe_serialization=True)")
            self.file_of = {}
            for name in files:
                with self._open(name) as f:
                    self.file_of.update({k: name for k in f.keys()})

    def _open(self, name: str):
        path = os.path.join(self.folder, name)
        try:
            return safe_open(path, framework="pt")
        except FileNotFoundError:
            raise ConfigError(f"{path} is named by the folder's safetensors index but does "
                              "not exist; restore it from the model's source") from None
        except SafetensorError as exc:
            raise ConfigError(f"{path} is not a readable safetensors file ({exc}): truncated "
                              "or damaged; restore it from the model's source") from None

    def names(self) -> set[str]:
        return set(self.file_of)

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors; each file is opened, read and closed (its mapping released)."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        out = {}
        for name, group in by_file.items():
            with self._open(name) as f:
                for n in group:
                    out[n] = self._reading(name, n, lambda: f.get_tensor(n))
                    check_finite(out[n], n, os.path.join(self.folder, name))
        return out

    def shape(self, name: str) -> list[int]:
        with self._open(self.file_of[name]) as f:
            return self._reading(self.file_of[name], name,
                                 lambda: f.get_slice(name).get_shape())

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (the first dimension) of tensor ``name``, without the rest; not
        checked finite (:meth:`read` of the whole tensor is, and counts what is not)."""
        with self._open(self.file_of[name]) as f:
            return self._reading(self.file_of[name], name,
                                 lambda: f.get_slice(name)[start:stop])

    def _reading(self, file: str, name: str, read):
        """``read()`` of tensor ``name`` in ``file``, a damaged file refused."""
        try:
            return read()
        except SafetensorError as exc:
            raise ConfigError(f"{os.path.join(self.folder, file)}: tensor {name} cannot be "
                              f"read ({exc}); restore the file from the model's source") from None


def check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """Refuse a weight that holds NaN or Inf (a damaged or diverged checkpoint)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ConfigError(f"{where}: tensor {name} holds {bad} NaN/Inf value(s) of "
                          f"{tensor.numel()}; the weights are damaged or diverged: use a "
                          "checkpoint whose weights are finite")


def read_hf_config(folder: str):
    """transformers' config object of a local folder (never downloads)."""
    from transformers import AutoConfig  # late: transformers takes seconds to import

    if not os.path.isdir(folder):
        raise ConfigError(not_a(folder, folder, "folder", "give a Hugging Face model folder "
                                "(config.json and *.safetensors)"))
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"{folder} has no config.json: give a Hugging Face model folder")
    load_json_object(path, "config.json")  # a syntax error named with its line and column
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # a user's file: transformers' (and huggingface_hub's strict
        # dataclass) refusal of a field of the wrong type or value, whatever its class
        first = ": ".join(ln.strip().rstrip(":") for ln in str(exc).strip().splitlines()[:2]) \
            or type(exc).__name__
        raise ConfigError(f"{path} is not a config transformers can read ({first}); give the "
                          "config.json of a LlamaForCausalLM or Qwen2ForCausalLM") from None


def model_config_of(folder: str) -> tuple[Family, ModelConfig]:
    """The family and the ldt ModelConfig of a Hugging Face folder."""
    hf = read_hf_config(folder)
    family = family_of_hf(hf)
    return family, to_model(family.model_fields(hf))


def parts(model: ModelConfig) -> Iterator[list[str]]:
    """ldt names grouped as the checkpoint's parts: embedding, each layer, norm + head."""
    names = list(full_shapes(model))
    yield [n for n in names if n.startswith("embedding.")]
    for i in range(model.num_layers):
        yield [n for n in names if n.startswith(f"decoder.layers.{i}.")]
    yield [n for n in names if not n.startswith(("embedding.", "decoder.layers."))]


def import_hf(hf_dir: str, out_dir: str, *, overwrite: bool = False,
              conf: Optional[dict] = None, log=print) -> ModelConfig:
    """Convert a Hugging Face folder of a known family (Llama incl. 3.1+, Qwen2, Qwen3,
    Qwen3-MoE: :data:`~ldt.models.hf.families.FAMILIES`) into an ldt checkpoint folder
    ``out_dir`` (usable as ``train.load=out_dir``); returns its ModelConfig.

    The folder is built beside ``out_dir`` and renamed into place once sealed and verified
    (:func:`ldt.storage.atomic.new_folder`): a refused or failed import leaves ``out_dir`` as
    it was, and an existing ``out_dir`` is refused unless ``overwrite`` (then replaced whole).
    ``conf``: also write ``conf/model/<name>.yaml`` (keys ``name``, ``seq_length``,
    ``params_dtype``; None values take the model's), for ``hydra.searchpath``."""
    src = _HfSource.open(hf_dir)
    model = src.model
    used: set[str] = set()
    written, dtype = [], None
    with new_folder(out_dir, flag="OUT", overwrite=overwrite,
                    inputs=[("HF_FOLDER", hf_dir)]) as tmp:
        for part, names in enumerate(parts(model)):
            tensors = {}
            for name in names:
                tensors[name], hf_names = src.tensor(name)
                dtype = dtype or tensors[name].dtype
                used.update(hf_names)
            write_tensors(tmp, part, tensors, IMPORT_STEP)
            written.append(f"stage_{part}")
            del tensors
        src.check_all_used(used)
        copied = _write_import_files(tmp, src, out_dir, conf, dtype)
        mark_complete(tmp, IMPORT_STEP)
        files.verify(tmp, which=written, hashes=True)  # what is renamed is what was meant
    log(f"ldt-convert: {src.family.architecture} ({model.num_layers} layers, hidden "
        f"{model.hidden_size}, {model.num_attention_heads} heads / "
        f"{model.num_query_groups} KV groups, vocab {model.vocab_size}) -> {out_dir}"
        + (f"; tokenizer files: {', '.join(copied)}" if copied else ""))
    return model


# what _own_head reads of each tensor at a time (not the whole, ~1 GB each for a 7B model)
HEAD_COMPARE_BYTES = 64 << 20


def _own_head(folder: "SafetensorsFolder") -> bool:
    """Whether a checkpoint whose config.json ties the head to the embedding stores a head
    of other values (``lm_head.weight`` beside ``model.embed_tokens.weight``)."""
    if "lm_head.weight" not in folder.names():
        return False
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    shape = folder.shape(embed)
    if folder.shape(head) != shape:
        return True
    if not shape:  # a scalar: no rows to slice (the shape checks refuse it later)
        return not torch.equal(*folder.read((embed, head)).values())
    # rows of at most HEAD_COMPARE_BYTES at 8 bytes an element, the widest dtype
    row_elements = max(1, prod(shape[1:]))
    step = max(1, HEAD_COMPARE_BYTES // (8 * row_elements))
    return any(not torch.equal(folder.read_rows(embed, start, start + step),
                               folder.read_rows(head, start, start + step))
               for start in range(0, shape[0], step))


@dataclass
class _HfSource:
    """A Hugging Face folder being imported: its family and model, its tensors, and the shape
    transformers gives each of them (checked before any arithmetic)."""

    hf_dir: str
    family: Family
    model: ModelConfig
    folder: SafetensorsFolder
    shapes: dict
    hf_expected: dict
    tied_head: bool

    @classmethod
    def open(cls, hf_dir: str) -> "_HfSource":
        family, model = model_config_of(hf_dir)
        folder = SafetensorsFolder(hf_dir)
        if model.tie_embeddings and _own_head(folder):
            # transformers computes with each tensor in its own role: so does the import
            model = dataclasses.replace(model, tie_embeddings=False)
        shapes = full_shapes(model)
        try:  # each source tensor's shape, checked before any arithmetic
            hf_expected = hf_shapes(read_hf_config(hf_dir))
        except ConfigError:
            raise
        except Exception as exc:  # transformers cannot build the model config.json describes
            raise ConfigError(
                f"{hf_dir}/config.json describes a model transformers cannot build "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                "); fix config.json or restore it from the model's source") from None
        tied_head = model.tie_embeddings and "lm_head.weight" not in folder.names()
        return cls(hf_dir, family, model, folder, shapes, hf_expected, tied_head)

    def tensor(self, name: str) -> tuple[torch.Tensor, tuple]:
        """ldt's tensor ``name`` joined from its Hugging Face tensors, and their names."""
        family, model, hf_dir = self.family, self.model, self.hf_dir
        hf_names, kind = family.sources(name)
        if name == "output_layer.weight" and self.tied_head:
            hf_names = ("model.embed_tokens.weight",)
        missing = [n for n in hf_names if n not in self.folder.names()]
        if missing:
            raise ConfigError(f"{hf_dir}: tensor {missing[0]} is missing; config.json says "
                              f"{family.architecture} with {model.num_layers} layers")
        parts_read = self.folder.read(hf_names)
        for n in hf_names:
            self._check_source_shape(n, tuple(parts_read[n].shape))
        tensor = family.join(kind, [parts_read[n] for n in hf_names], model)
        want = self.shapes[name]
        if tuple(tensor.shape) != want:
            raise ConfigError(f"{hf_dir}: {' + '.join(hf_names)} gives {name} of shape "
                              f"{tuple(tensor.shape)}, but config.json implies {want}")
        return tensor, hf_names

    def _check_source_shape(self, n: str, got: tuple) -> None:
        want, model = self.hf_expected.get(n), self.model
        if want is not None and got != want:
            raise ConfigError(
                f"{self.hf_dir}: tensor {n} has shape {got}, but its config.json "
                f"({self.family.architecture}, hidden {model.hidden_size}, "
                f"{model.num_attention_heads} heads / {model.num_query_groups} KV "
                f"groups, vocab {model.vocab_size}) implies {want}: the weights "
                "and config.json are from different models; give the config.json "
                "the weights were saved with")

    def check_all_used(self, used: set[str]) -> None:
        """Every tensor of the folder was read, or is one the family drops."""
        unknown = sorted(n for n in self.folder.names() - used if not self.family.dropped(n))
        if unknown:
            raise ConfigError(f"{self.hf_dir}: tensor {unknown[0]} has no rule in the "
                              f"{self.family.name} table (ldt/models/hf/families.py): the "
                              "checkpoint's architecture differs from what config.json declares")


def _write_import_files(tmp: str, src: _HfSource, out_dir: str, conf: Optional[dict],
                        dtype) -> list[str]:
    """model.json, the source's config.json, its tokenizer files and (``conf``) a model
    YAML; returns the tokenizer files copied."""
    write_model_json(tmp, src.model)
    shutil.copy(os.path.join(src.hf_dir, "config.json"), os.path.join(tmp, HF_CONFIG))
    copied = _copy_tokenizer(src.hf_dir, tmp)
    if conf is not None:
        name = conf.get("name") or os.path.basename(os.path.abspath(out_dir))
        write_model_yaml(src.model, os.path.join(tmp, "conf", "model", f"{name}.yaml"),
                         seq_length=conf.get("seq_length"),
                         params_dtype=conf.get("params_dtype")
                         or str(dtype).replace("torch.", ""))
    return copied


def export_hf(ldt_path: str, out_dir: str, *, model: Optional[ModelConfig] = None,
              overwrite: bool = False, log=print) -> str:
    """Write an ldt checkpoint (an import or a training checkpoint, any layout) as a Hugging
    Face folder that ``transformers`` loads. ``model``: the ModelConfig when the checkpoint has
    no ``model.json``.

    The checkpoint is checked against the checksums it was written with before a tensor is
    read (a damaged one is refused, never passed on), every tensor is checked for NaN/Inf,
    and the folder is built beside ``out_dir`` and renamed into place when complete: an
    existing ``out_dir`` is refused unless ``overwrite``, and then replaced whole (no old
    ``model.safetensors`` is left beside the new shards)."""
    inputs = [("CHECKPOINT", ldt_path)]
    check_output(out_dir, flag="OUT", overwrite=overwrite, inputs=inputs)  # before any read
    found = _checkpoint_to_export(ldt_path, log)
    model = _exported_model(found, model)
    family = family_of_model(model)
    index = tensor_index(found)
    hf_config = _hf_config_of(found, model, family, index)
    if not os.path.exists(os.path.join(found, HF_CONFIG)):
        log(f"ldt-convert: {found} was trained from scratch, not from an import: the export "
            "names no special tokens (config.json's bos/eos/pad_token_id are null, not "
            "transformers' defaults) and holds no tokenizer; copy the run's tokenizer files "
            "into OUT and set eos_token_id to its end-of-document id")
    expected = hf_shapes(hf_config)
    groups = list(parts(model))
    weight_map, total = {}, 0
    with new_folder(out_dir, flag="OUT", overwrite=overwrite, inputs=inputs) as tmp:
        for k, names in enumerate(groups):
            out = _export_part(found, index, names, model, family, hf_config, expected)
            file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(out, os.path.join(tmp, file), metadata={"format": "pt"})
            weight_map.update({n: file for n in out})
            total += sum(t.numel() * t.element_size() for t in out.values())
        if expected:
            raise ConfigError(f"export of {found}: nothing gives transformers' "
                              f"{family.architecture} its {sorted(expected)[0]}")
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=1)
        hf_config.to_json_file(os.path.join(tmp, "config.json"))
        _copy_tokenizer(found, tmp)
        _check_shards(tmp, weight_map)
    log(f"ldt-convert: {found} -> {out_dir} ({family.architecture}, {len(groups)} files)")
    return out_dir


def _checkpoint_to_export(ldt_path: str, log) -> str:
    """The complete checkpoint folder ``ldt_path`` names, its tensor files verified against
    their checksums; refused while a training run writes there."""
    check_not_training(ldt_path, f"CHECKPOINT {ldt_path}")
    found = files.latest(ldt_path)
    if found is None and os.path.exists(ldt_path) and not os.path.isdir(ldt_path):
        raise ConfigError(not_a(ldt_path, f"CHECKPOINT {ldt_path}", "folder", "give a run "
                                "folder with checkpoints/, one of its checkpoints/step_N folders "
                                "or an ldt-convert import"))
    if found is None:
        raise ConfigError(f"{ldt_path!r} holds no complete ldt checkpoint (no "
                          f"{files.COMPLETE} marker); give a run folder with checkpoints/, "
                          "one of its checkpoints/step_N folders or an ldt-convert import")
    skipped = files.skipped(ldt_path)
    if skipped:
        log(f"ldt-convert: {skipped}")
    stages = [p for p in files.parts(found) if p.startswith("stage_")]
    files.verify(found, which=stages, hashes=True, field="CHECKPOINT")
    return found


def _exported_model(found: str, model: Optional[ModelConfig]) -> ModelConfig:
    """The checkpoint's ModelConfig (its model.json, else ``model``), refused where a Hugging
    Face family cannot hold it."""
    model = read_model_json(found) or model
    if model is None:
        raise ConfigError(f"{found} has no model.json, so the model it holds is unknown; export a "
                          "checkpoint written by ldt-train or ldt-convert import")
    if model.mtp_num_layers:
        raise ConfigError(
            f"{found} has {model.mtp_num_layers} MTP layers (model.mtp_num_layers), which the "
            "Hugging Face families ldt exports do not have; export would drop them: train "
            "without MTP, or read the checkpoint with ldt.storage")
    return model


def _hf_config_of(found: str, model: ModelConfig, family: Family, index: dict):
    """transformers' config of the export, in the checkpoint's dtype, on top of the imported
    config.json where the checkpoint came from an import."""
    dtype = index["embedding.word_embeddings.weight"][1].properties.dtype
    # without an import's config.json, transformers' default ids (Llama's bos 1, eos 2) would
    # name tokens the run never trained as such
    base = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if os.path.exists(os.path.join(found, HF_CONFIG)):
        base = load_json_object(os.path.join(found, HF_CONFIG), "the import's config.json")
    return family.hf_config(model, dtype, base)


def _export_part(found: str, index: dict, names: list[str], model: ModelConfig, family: Family,
                 hf_config, expected: dict) -> dict[str, torch.Tensor]:
    """One part's tensors under transformers' names; each is taken off ``expected`` (name ->
    shape still to write), and a name or shape transformers would not load is refused."""
    if model.tie_embeddings:
        names = [n for n in names if n != "output_layer.weight"]
    full = read_tensors(index, names)
    out = {}
    for name in names:
        tensor = full.pop(name)
        check_finite(tensor, name, found)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensor = tensor[:model.vocab_size]  # drop the vocabulary padding
        hf_names, kind = family.sources(name)
        for hf_name, value in zip(hf_names, family.split(kind, tensor, model)):
            if expected.pop(hf_name, None) != tuple(value.shape):
                raise ConfigError(f"export of {found}: {name} gives {hf_name} of shape "
                                  f"{tuple(value.shape)}, but transformers' "
                                  f"{family.architecture} has "
                                  f"{hf_shapes(hf_config).get(hf_name, 'no such tensor')}")
            out[hf_name] = value.contiguous()
    return out


def hf_shapes(hf_config) -> dict[str, tuple]:
    """Name -> shape of every tensor transformers saves for ``hf_config``'s model (a tied head
    once, under the embedding's name), from a skeleton whose weights are never allocated."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from transformers.core_model_loading import revert_weight_conversion

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    skeleton.tie_weights()  # under init_empty_weights the head is not tied at construction
    # as save_pretrained writes them: transformers 5 keeps a MoE layer's experts fused in
    # memory (mlp.experts.gate_up_proj [E, 2f, h]) and splits them back per expert on save
    params = revert_weight_conversion(skeleton, dict(skeleton.named_parameters()))
    return {n: tuple(p.shape) for n, p in params.items()}


def _check_shards(folder: str, weight_map: dict) -> None:
    """Every shard written opens and holds the tensors the index gives it."""
    written = SafetensorsFolder(folder)
    for name in sorted(set(weight_map.values())):
        with written._open(name) as f:
            want = {n for n, file in weight_map.items() if file == name}
            if set(f.keys()) != want:
                raise ConfigError(f"{os.path.join(folder, name)} does not hold the tensors its "
                                  "index names (a write went wrong); nothing was replaced")


def _copy_tokenizer(src: str, dst: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def write_model_yaml(model: ModelConfig, path: str, *, seq_length: Optional[int] = None,
                     params_dtype: Optional[str] = None) -> str:
    """A ``conf/model``-style YAML of ``model`` (for ``hydra.searchpath`` + ``model=NAME``)."""
    import dataclasses

    from omegaconf import OmegaConf

    fields = dataclasses.asdict(model)
    fields["name"] = os.path.splitext(os.path.basename(path))[0]
    if seq_length:
        fields["seq_length"] = seq_length
    if params_dtype:
        fields["params_dtype"] = params_dtype
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("# Written by ldt-convert from a Hugging Face checkpoint.\ndefaults:\n"
                "  - base_model\n")
        f.write(OmegaConf.to_yaml(OmegaConf.create(fields)))
    return path
