"""Hydra plumbing: the ``conf/`` tree ships inside the package as ``ldt.conf``."""

from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig

from ldt.config import register_configs

CONFIG_MODULE = "ldt.conf"
CONFIG_NAME = "config"


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed, type-checked config (same result as the Hydra app, without a run folder)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
