"""Hugging Face checkpoints in and out: family tables (:mod:`.families`), streaming
conversion (:mod:`.convert`). ``ldt-convert`` (``tools/convert.py``) is the command line."""

from ldt.models.hf.convert import export_hf, import_hf, model_config_of, write_model_yaml

__all__ = ["export_hf", "import_hf", "model_config_of", "write_model_yaml"]
