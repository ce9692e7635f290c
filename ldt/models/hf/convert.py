"""Hugging Face folder <-> ldt checkpoint, one tensor at a time.

Import (:func:`import_hf`): ``config.json`` gives the family and the ModelConfig; the
safetensors files (one, or sharded with ``model.safetensors.index.json``) are opened lazily
with the ``safetensors`` package and read one tensor at a time, one part of the model at a
time (the embedding, each decoder layer, the final norm and head), each part written as one
``stage_<k>`` folder through :func:`ldt.storage.tensors.write_tensors`. So the peak memory
is about one decoder layer, not the model. ``model.json`` records the architecture, the
source's ``config.json`` and tokenizer files are copied next to it (``data.tokenizer=<out>``
finds them), and COMPLETE is written last. The step recorded is -1: both ``train.load`` and
``train.resume`` start at step 0.

Export (:func:`export_hf`) reads an ldt checkpoint (an import, or any training checkpoint,
whatever its layout) part by part and writes sharded safetensors plus their index, a
``config.json`` built with ``transformers``' config class, and the tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator, Optional

import torch

from ldt.config import ConfigError, ModelConfig, to_model
from ldt.models.hf.families import Family, family_of_hf, family_of_model

IMPORT_STEP = -1  # "before step 0": resume and load both start at step 0
HF_CONFIG = "hf_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


class SafetensorsFolder:
    """The tensors of a Hugging Face folder, by name, read lazily (one file open at a time)."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.file_of = dict(json.load(f)["weight_map"])
        else:
            files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            if not files:
                raise ConfigError(f"{folder} has no *.safetensors file; ldt-convert reads "
                                  "safetensors (save the model with safe_serialization=True)")
            from safetensors import safe_open

            self.file_of = {}
            for name in files:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    self.file_of.update({k: name for k in f.keys()})

    def names(self) -> set[str]:
        return set(self.file_of)

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors; each file is opened, read and closed (its mapping released)."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        out = {}
        for name, group in by_file.items():
            with safe_open(os.path.join(self.folder, name), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in group})
        return out


def read_hf_config(folder: str):
    """transformers' config object of a local folder (never downloads)."""
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(folder, "config.json")):
        raise ConfigError(f"{folder} has no config.json: give a Hugging Face model folder")
    return AutoConfig.from_pretrained(folder, local_files_only=True)


def model_config_of(folder: str) -> tuple[Family, ModelConfig]:
    """The family and the ldt ModelConfig of a Hugging Face folder."""
    hf = read_hf_config(folder)
    family = family_of_hf(hf)
    return family, to_model(family.model_fields(hf))


def parts(model: ModelConfig) -> Iterator[list[str]]:
    """ldt names grouped as the checkpoint's parts: embedding, each layer, norm + head."""
    from ldt.models.arch import full_shapes

    names = list(full_shapes(model))
    yield [n for n in names if n.startswith("embedding.")]
    for i in range(model.num_layers):
        yield [n for n in names if n.startswith(f"decoder.layers.{i}.")]
    yield [n for n in names if not n.startswith(("embedding.", "decoder.layers."))]


def import_hf(hf_dir: str, out_dir: str, *, log=print) -> ModelConfig:
    """Convert a Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` folder into an ldt
    checkpoint folder ``out_dir`` (usable as ``train.load=out_dir``); returns its ModelConfig."""
    from ldt.models.arch import full_shapes, write_model_json
    from ldt.storage.tensors import mark_complete, write_tensors

    family, model = model_config_of(hf_dir)
    source = SafetensorsFolder(hf_dir)
    shapes = full_shapes(model)
    tied_head = model.tie_embeddings and "lm_head.weight" not in source.names()
    used: set[str] = set()
    if os.path.exists(os.path.join(out_dir, "COMPLETE")):
        os.remove(os.path.join(out_dir, "COMPLETE"))  # a re-import is incomplete until done
    for part, names in enumerate(parts(model)):
        tensors = {}
        for name in names:
            hf_names, kind = family.sources(name)
            if name == "output_layer.weight" and tied_head:
                hf_names = ("model.embed_tokens.weight",)
            missing = [n for n in hf_names if n not in source.names()]
            if missing:
                raise ConfigError(f"{hf_dir}: tensor {missing[0]} is missing; config.json says "
                                  f"{family.architecture} with {model.num_layers} layers")
            tensor = family.join(kind, [source.read([n])[n] for n in hf_names], model)
            if tuple(tensor.shape) != shapes[name]:
                raise ConfigError(f"{hf_dir}: {' + '.join(hf_names)} gives {name} of shape "
                                  f"{tuple(tensor.shape)}, but config.json implies {shapes[name]}")
            tensors[name] = tensor
            used.update(hf_names)
        write_tensors(out_dir, part, tensors, IMPORT_STEP)
        del tensors
    unknown = sorted(n for n in source.names() - used if not family.dropped(n))
    if unknown:
        raise ConfigError(f"{hf_dir}: tensor {unknown[0]} has no rule in the {family.name} "
                          "table (ldt/models/hf/families.py): the checkpoint's architecture "
                          "differs from what config.json declares")
    write_model_json(out_dir, model)
    shutil.copy(os.path.join(hf_dir, "config.json"), os.path.join(out_dir, HF_CONFIG))
    copied = _copy_tokenizer(hf_dir, out_dir)
    mark_complete(out_dir, IMPORT_STEP)
    log(f"ldt-convert: {family.architecture} ({model.num_layers} layers, hidden "
        f"{model.hidden_size}, {model.num_attention_heads} heads / "
        f"{model.num_query_groups} KV groups, vocab {model.vocab_size}) -> {out_dir}"
        + (f"; tokenizer files: {', '.join(copied)}" if copied else ""))
    return model


def export_hf(ldt_path: str, out_dir: str, *, model: Optional[ModelConfig] = None,
              log=print) -> str:
    """Write an ldt checkpoint (an import or a training checkpoint, any layout) as a Hugging
    Face folder that ``transformers`` loads. ``model``: the ModelConfig when the checkpoint has
    no ``model.json``."""
    from safetensors.torch import save_file

    from ldt.models.arch import read_model_json
    from ldt.storage.checkpoint_files import latest
    from ldt.storage.tensors import read_tensors, tensor_index

    found = latest(ldt_path)
    if found is None:
        raise ConfigError(f"{ldt_path!r} holds no complete ldt checkpoint")
    model = read_model_json(found) or model
    if model is None:
        raise ConfigError(f"{found} has no model.json; pass the model config (--model NAME)")
    if model.mtp_num_layers:
        raise ConfigError(
            f"{found} has {model.mtp_num_layers} MTP layers (model.mtp_num_layers), which the "
            "Hugging Face families ldt exports (Llama, Qwen2) do not have; export would drop "
            "them: train without MTP, or read the checkpoint with ldt.storage")
    family = family_of_model(model)
    index = tensor_index(found)
    os.makedirs(out_dir, exist_ok=True)
    groups = list(parts(model))
    weight_map, total, dtype = {}, 0, None
    for k, names in enumerate(groups):
        if model.tie_embeddings:
            names = [n for n in names if n != "output_layer.weight"]
        full = read_tensors(index, names)
        out = {}
        for name in names:
            tensor = full.pop(name)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                tensor = tensor[:model.vocab_size]  # drop the vocabulary padding
            dtype = dtype or tensor.dtype
            hf_names, kind = family.sources(name)
            for hf_name, value in zip(hf_names, family.split(kind, tensor, model)):
                out[hf_name] = value.contiguous()
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(out, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in out})
        total += sum(t.numel() * t.element_size() for t in out.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    base = None
    if os.path.exists(os.path.join(found, HF_CONFIG)):
        with open(os.path.join(found, HF_CONFIG)) as f:
            base = json.load(f)
    family.hf_config(model, dtype, base).to_json_file(os.path.join(out_dir, "config.json"))
    _copy_tokenizer(found, out_dir)
    log(f"ldt-convert: {found} -> {out_dir} ({family.architecture}, {len(groups)} files)")
    return out_dir


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
