"""Typed configs behind the Hydra YAML in ``conf/``.

The YAML files are the public interface (see DESIGN.md); these dataclasses give every key a type
and a docstring, so a typo in a key is an error and not a silent default. Hydra merges the YAML
onto these schemas (registered in the ConfigStore by :func:`register_configs`).

Checks that need only one config group live in ``__post_init__``; checks that need several
(world size, heads divisible by TP, layout vs layer count) live in :mod:`ldt.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf

DEVICE_TYPES = ("cuda", "npu", "cpu")


class ConfigError(ValueError):
    """A config that cannot work. The message names the field, the value and the fix."""


@dataclass
class StageConfig:
    name: str = MISSING
    """Human name of the stage, e.g. ``edge`` or ``cloud0``; shown in the rank map and errors."""
    device: str = "cpu"
    """Device type of every rank of this stage: ``cuda``, ``npu`` or ``cpu``."""
    tp: int = 1
    """Tensor-parallel size of this stage (VTP: each stage has its own)."""


@dataclass
class ClusterConfig:
    stages: List[StageConfig] = MISSING
    """Pipeline order, one entry per stage."""
    u_shape: bool = False
    """Stage 0 also runs the end chunk (last layers, final norm, head, loss): edge-cloud split."""
    layout: Optional[str] = None
    """Megatron layout string (``E``, ``t``, ``L``, ``|``, ``*n``); None splits layers evenly."""
    dp: int = 1
    """Data-parallel replicas of the whole pipeline."""
    host_staging: str = "auto"
    """Boundary transport: ``auto`` (host-staged gloo only where device types differ) or
    ``always`` (force copy-to-host + gloo on every boundary; used to test that path on CPU)."""


@dataclass
class ModelConfig:
    name: str = "gpt"
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    ffn_hidden_size: Optional[int] = None
    """Defaults to 4 * hidden_size."""
    num_query_groups: Optional[int] = None
    """GQA groups; None means plain multi-head attention."""
    vocab_size: int = 256
    seq_length: int = 64
    max_position_embeddings: Optional[int] = None
    """Defaults to seq_length."""
    params_dtype: str = "float32"
    """``float32``, ``bfloat16`` or ``float16``; also the dtype of tensors at stage boundaries."""
    tie_embeddings: bool = False
    """Share input embedding and output head (only where both sit on one stage, e.g. U-shape)."""

    def __post_init__(self) -> None:
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"model.params_dtype={self.params_dtype!r} is not supported; "
                "use float32, bfloat16 or float16"
            )


@dataclass
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run."""
    micro_batch_size: int = 2
    num_microbatches: int = 4
    """Micro-batches per step per data-parallel replica (global batch = dp * m * mbs)."""
    schedule: str = "auto"
    """``auto`` (U-shape schedule when u_shape; else 1F1B, or interleaved when the layout has
    k*P segments), ``1f1b`` or ``interleaved`` (needs such a layout)."""
    runtime: str = "auto"
    """Who runs a plain pipeline's schedule: ``megatron`` (its own 1F1B / interleaved; the
    default) or ``ldt`` (ldt's runtime over the same 1F1B action lists the simulator uses; it
    records per-action times). The U-shape always runs on ldt's runtime."""
    overlap_p2p_comm: bool = False
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    verify: bool = False
    """Also run the same steps in a single-process reference and report the loss difference."""
    audit_comm: bool = False
    """Record every tensor crossing a stage boundary to ``comm_audit.jsonl`` in the run folder."""
    check_finite: Optional[bool] = None
    """Check received boundary tensors for NaN/Inf; None means on when ``verify`` is on."""
    save_every: int = 0
    """Write a checkpoint every N steps (0: never). When set, a run stopped by SIGTERM, SIGINT
    or SIGHUP also writes one at the step it stops after."""
    keep_last: int = 0
    """Keep only the newest N complete checkpoints of the run folder (0: keep all)."""
    resume: Optional[str] = None
    """Checkpoint folder to continue from."""
    comm_timeout_s: float = 60.0
    """Timeout of every process group ldt creates: a dead rank stops the others after this."""
    log_interval: int = 10
    """When stdout is not a terminal (a log file), print one progress line every N steps
    (on a terminal: a progress bar). TensorBoard events are flushed as often."""
    stop_on_nonfinite: bool = True
    """A NaN/Inf loss or gradient norm stops the run (exit status 1, naming the step and the
    stage); false: record it and go on."""
    peak_tflops: Dict[str, float] = field(
        default_factory=lambda: {"cuda": 0.0, "npu": 0.0, "cpu": 0.0})
    """Peak TFLOP/s of one device, per device type, for metrics.csv's ``mfu`` (model FLOPs
    utilisation), e.g. ``train.peak_tflops.cuda=989`` (H100 SXM, dense BF16); 0: unknown, no
    ``mfu`` (``tflops_per_device`` is always reported)."""
    tensorboard: bool = True
    """Write TensorBoard event files (the per-step metrics) into the run folder."""
    eval_every: int = 0
    """Every N steps and after the last, the loss on held-out data (m micro-batches, forward
    only) goes to metrics.csv's ``eval_loss`` and the summary (0: never)."""


@dataclass
class DataConfig:
    path: Optional[str] = None
    """A text file to train on; None uses a corpus every machine has (Python's own sources)."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of the corpus."""


@dataclass
class LdtConfig:
    cluster: ClusterConfig = MISSING
    model: ModelConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run_dir: str = "outputs/run"
    """Where the run's outputs go (config.yaml sets a time-stamped folder)."""


def register_configs() -> None:
    """Register the schemas so Hydra type-checks ``conf/`` (``base_*`` names, see config.yaml)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=LdtConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)


def to_cluster(obj: Any) -> ClusterConfig:
    """A ClusterConfig from a dataclass, a DictConfig or a plain dict (for tests and the API)."""
    if isinstance(obj, ClusterConfig):
        return obj
    return _typed(ClusterConfig, obj, "cluster")


def to_model(obj: Any) -> ModelConfig:
    if isinstance(obj, ModelConfig):
        return obj
    return _typed(ModelConfig, obj, "model")


def load_cluster_yaml(path: str) -> ClusterConfig:
    """Load a cluster file (as written by users or ``ldt-plan``), with type checking."""
    return to_cluster(OmegaConf.load(path))


def _plain(obj: Any) -> Any:
    """A plain container; drops Hydra's ``defaults`` list so a conf/ file also loads bare."""
    if OmegaConf.is_config(obj):
        obj = OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, dict) and "defaults" in obj:
        obj = {k: v for k, v in obj.items() if k != "defaults"}
    return obj


def _typed(schema: type, obj: Any, group: str) -> Any:
    """Merge onto the schema and build the dataclass; a wrong key or type is a ConfigError."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), _plain(obj)))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(
            f"{group}.{key}: {str(exc).splitlines()[0]}; check the spelling "
            f"against the fields of {schema.__name__} (see ldt/config.py)"
        ) from None
