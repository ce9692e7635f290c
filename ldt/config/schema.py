"""Typed configs behind the Hydra YAML in ``conf/``.

The YAML files are the public interface (see DESIGN.md); these dataclasses give every key a type
and a docstring, so a typo in a key is an error and not a silent default. Hydra merges the YAML
onto these schemas (registered in the ConfigStore by :func:`register_configs`).

Checks that need only one config group live in ``__post_init__``; checks that need several
(world size, heads divisible by TP, layout vs layer count) live in :mod:`ldt.topology.validate`.
The config layer: this module (the cluster, train and data groups, the whole config, and
``to_*`` for a dict that enters from Hydra, a file or the API), :mod:`ldt.config.model` (the
model group), :mod:`ldt.config.checks` (refusals they share) and :mod:`ldt.config.load` (the
one loader of typed YAML). Every name is importable from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from ldt.config.checks import at_least, given
from ldt.config.checks import (RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS,  # noqa: F401
                               RECOMPUTE_MODULES, check_recompute)  # re-exported
from ldt.config.errors import ConfigError  # noqa: F401  (re-exported: every refusal raises it)
import ldt.config.load as config_load
from ldt.config.load import load_typed, typed
from ldt.config.model import ModelConfig

DEVICE_TYPES = ("cuda", "npu", "cpu")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""``train.log_level``'s choices (Python logging's levels; :mod:`ldt.launch.quiet` sets them)."""
MAX_TIMEOUT_S = 365 * 24 * 3600.0  # far below what timedelta and the process groups can hold


@dataclass
class RecomputeConfig:
    """``cluster.stages[i].recompute``: this stage's activation recomputation (megatron-core's
    own, in the TransformerConfig of the stage's chunks). With a granularity it replaces the
    model-wide ``model.recompute_*`` settings on this stage."""

    granularity: Optional[str] = None
    """``null``: the model's setting (``model.recompute_granularity``); ``none``: keep every
    activation on this stage; ``selective`` (recompute ``modules``; megatron's default: the
    core attention) or ``full`` (keep only each layer group's input)."""
    method: Optional[str] = None
    """``full`` only: ``uniform`` (every group of ``num_layers`` layers of a chunk keeps only
    its input) or ``block`` (the first ``num_layers`` layers of each chunk are recomputed)."""
    num_layers: Optional[int] = None
    """``full`` only: layers per group (uniform) or layers recomputed per chunk (block)."""
    modules: Optional[List[str]] = None
    """``selective`` only: which submodules, from ``core_attn``, ``mlp``, ``layernorm`` and,
    on a stage with MoE layers, ``moe`` (default ``[core_attn]``)."""


@dataclass
class StageConfig:
    name: str = MISSING
    """Human name of the stage, e.g. ``edge`` or ``cloud0``; shown in the rank map and errors."""
    device: str = "cpu"
    """Device type of every rank of this stage: ``cuda``, ``npu`` or ``cpu``."""
    tp: int = 1
    """Tensor-parallel size of this stage (VTP: each stage has its own)."""
    dp: Optional[int] = None
    """Data-parallel replicas of this stage (VDP: each stage its own); None: ``cluster.dp``.
    At every boundary one side's dp must divide the other's; the global batch is that of
    uniform DP with dp = the largest stage dp (docs/vdp.md)."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """This stage's activation recomputation (unset: the model's ``model.recompute_*``)."""
    memory_gib: Optional[float] = None
    """Device memory one rank of this stage may fill, GiB (the card's memory less what the
    runtime and fragmentation take; ``ldt-plan`` writes the inventory's ``memory_gib -
    reserved_gib``). Given, ``ldt-train`` estimates every rank's memory before anything starts
    and refuses a config that does not fit (docs/memory.md)."""
    ep: int = 1
    """Expert parallelism of this stage (MoE models): its experts spread over ``ep`` of its TP
    ranks, each expert split over the other ``tp / ep`` (megatron's expert-tensor-parallel
    size); ``ep`` divides ``tp``. 1: experts split like the dense layers."""


@dataclass
class ClusterConfig:
    stages: List[StageConfig] = MISSING
    """Pipeline order, one entry per stage."""
    u_shape: bool = False
    """Stage 0 also runs the end chunk (last layers, final norm, head, loss): edge-cloud split."""
    layout: Optional[str] = None
    """Megatron layout string (``E``, ``t``, ``L``, ``|``, ``*n``); None splits layers evenly."""
    dp: int = 1
    """Data-parallel replicas of the whole pipeline (the default of every stage's ``dp``)."""
    host_staging: str = "auto"
    """Boundary transport: ``auto`` (host-staged gloo only where device types differ) or
    ``always`` (force copy-to-host + gloo on every boundary; used to test that path on CPU)."""
    boundary_fanout: str = "auto"
    """How a message reaches the TP ranks of the stage that receives it (docs/network.md):
    ``auto``: where both stages of a boundary run on one node (the same host name and torchrun
    node rank), and across nodes for a message of at most 64 KiB, the sending stage sends a copy
    straight to every TP rank (one hop; its TP ranks share the copies, TP rank i to TP rank i,
    unless it is sequence-parallel: then its leader sends them); otherwise one copy crosses to
    the receiving leader, which relays it in pieces as they arrive. ``never``: always one copy
    and the relay (a slow link between stages on one node). ``always``: always a copy per TP
    rank (a fast link between nodes). A message whose shape crosses first
    (``variable_seq_lengths``) and per-stage-DP boundaries always relay."""
    link_delay_ms: Any = 0.0
    """Emulated one-way link delay, a measurement tool (off: 0): a number for every stage
    boundary, or a list with one number per boundary ``i -> i+1`` in pipeline order (the last,
    ``P-1 -> 0``, is the U-shape's return path). Every message crossing a boundary, either way,
    is delivered no earlier than that long after it could have been; see docs/network.md."""
    inventory: Optional[str] = None
    """Elastic mode (docs/elastic.md): an inventory (``conf/inventory`` name or path) whose kinds
    and links the planner prices; under torchrun every start plans the stages, layout, dp and
    micro-batches from the nodes that are there (each names its kind in ``LDT_NODE_KIND``),
    keeping the global batch. ``stages`` is then left empty (``[]``)."""


OPTIMIZER_NAMES = ("adam", "sgd")
"""``train.optimizer.name``'s values (conf/train/optimizer/)."""


@dataclass
class OptimizerSettings:
    """``train.optimizer`` (conf/train/optimizer/{adam,sgd}.yaml): which megatron-core optimizer
    steps the fp32 main parameters, and its own settings (megatron's OptimizerConfig names)."""

    name: str = "adam"
    """``adam`` (decoupled weight decay, megatron-core's default) or ``sgd`` (with momentum)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9

    def __post_init__(self) -> None:
        if given(self.name) and self.name not in OPTIMIZER_NAMES:
            raise ConfigError(f"train.optimizer.name={self.name!r} is not supported; use "
                              "train/optimizer=adam or train/optimizer=sgd")
        for key in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            value = getattr(self, key)
            if given(value) and not 0.0 <= value < 1.0:
                raise ConfigError(f"train.optimizer.{key}={value} must be in [0, 1)")
        at_least("train.optimizer", self, "adam_eps", 0, "a typical value is 1e-8")


@dataclass
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run."""
    micro_batch_size: int = 2
    num_microbatches: int = 4
    """Micro-batches per step per data-parallel replica (global batch = dp * m * mbs)."""
    schedule: str = "auto"
    """``auto`` (U-shape schedule when u_shape; else 1F1B, or interleaved when the layout has
    k*P segments), ``1f1b``, ``interleaved`` (needs such a layout) or ``zb`` (zero-bubble:
    each backward split into B and a later W, docs/zero_bubble.md; on ldt's runtime)."""
    cost_inventory: Optional[str] = None
    """``train.schedule=zb``: the inventory (``conf/inventory`` name or path) whose device kinds
    price each stage's F, B and W and each boundary's transfer, the costs the zero-bubble order
    is generated from (each stage takes the only kind of its device type; a U-shape's stage 0
    the inventory's edge kind). None: an elastic run's ``cluster.inventory``, else
    ``cpu_local``'s figures for every device type (the stages then differ by their layers,
    chunks, TP and recomputation, not by their device's speed). ``ldt-plan`` writes its own."""
    cost_run: Optional[str] = None
    """``train.schedule=zb``: the folder of an earlier ``ldt-train`` run of this cluster on
    ldt's runtime; the zero-bubble order is then generated from the times it measured
    (``action_times.csv``: each stage's F, B and W, a backward of today's schedule split as the
    cost model splits it, and each boundary's transfer), not from an inventory's
    (docs/zero_bubble.md). Read on every rank: on several hosts, copy it to each."""
    runtime: str = "auto"
    """Who runs a plain pipeline's schedule: ``megatron`` (its own 1F1B / interleaved), ``ldt``
    (ldt's runtime over the same 1F1B action lists the simulator uses; it records per-action
    times) or ``auto`` (megatron's, except where only ldt's runs the schedule: per-stage dp,
    ``zb``). The U-shape always runs on ldt's runtime (``megatron`` is refused there)."""
    overlap_p2p_comm: bool = False
    prefetch: int = 0
    """U-shape only: extra micro-batches in flight per slow edge <-> cloud link, so that link
    latency adds no steady-state bubble (0: the plain U-shape; ``ldt-plan`` picks it from the
    inventory's link latency; see docs/network.md)."""
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    """Clip the global gradient norm (over every stage, each parameter counted once) to this
    (0: no clipping); megatron-core's optimizer does it."""
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    """megatron-core optimizer and its settings (group ``train/optimizer``: adam, sgd)."""
    fp32_main_params: Optional[bool] = None
    """With ``model.params_dtype`` bfloat16/float16: the optimizer steps fp32 copies of the
    weights (and gradients are accumulated and reduced in fp32); None: true for bf16/fp16.
    false (bf16 only): the optimizer updates the 16-bit weights in place."""
    distributed_optimizer: bool = False
    """megatron-core's distributed optimizer: main params and optimizer state sharded over the
    stage's data-parallel ranks (gradients reduce-scattered, params all-gathered)."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's data-parallel reduce during the backward pass, as soon as
    the bucket's last micro-batch gradients are in."""
    ddp_bucket_size: Optional[int] = None
    """Elements per gradient bucket of megatron's DDP, with ``overlap_grad_reduce`` only
    (None: its default, at least 40M; without overlap one bucket)."""
    loss_scale: Optional[float] = None
    """float16 only: a constant loss scale; None: dynamic loss scaling (megatron's)."""
    initial_loss_scale: Optional[float] = None
    """float16 with dynamic loss scaling: the scale of the first step (megatron's
    ``--initial-loss-scale``; None: 65536). A step whose gradients overflow is skipped and the
    scale backs off (halves after megatron's hysteresis of 2 overflows); the run goes on."""
    seed: int = 1234
    verify: bool = False
    """Also run the same steps in a single-process reference and report the loss difference."""
    audit_comm: bool = False
    """Record every tensor crossing a stage boundary to ``comm_audit.jsonl`` in the run folder."""
    check_finite: Optional[bool] = None
    """Check received boundary tensors for NaN/Inf; None means on when ``verify`` is on."""
    save_every: int = 0
    """Write a checkpoint every N steps and after the last step (0: never). When set, a run
    stopped by SIGTERM, SIGINT or SIGHUP also writes one at the step it stops after."""
    keep_last: int = 0
    """Keep only the newest N complete checkpoints of the run folder (0: keep all)."""
    snapshot_dir: Optional[str] = None
    """A folder in host memory (e.g. ``/dev/shm``, the same path on every host): after every
    step each rank's own state (its shard of what a checkpoint holds) is copied and written
    there in the background, two
    generations with checksums, and a restart of the run in the same layout (torchrun, or
    ``train.resume`` of the run folder) continues from the newest snapshot every rank has
    when it is newer than the checkpoint. None: off. See docs/elastic.md."""
    snapshot_every: int = 1
    """With ``snapshot_dir``: a snapshot after every N-th step (steps N-1, 2N-1, ..., and the
    step a stop signal ends), so a lost host costs at most N steps, and the snapshot's CPU
    and its copy to another host have N steps to run beside training. 1: every step."""
    resume: Optional[str] = None
    """Checkpoint folder to continue from."""
    load: Optional[str] = None
    """Checkpoint folder to take the weights from (e.g. ``ldt-convert``'s output for a Hugging
    Face model), into any layout: no optimizer state, training starts at step 0."""
    comm_timeout_s: float = 60.0
    """Timeout of every process group ldt creates: a dead rank stops the others after this."""
    log_interval: int = 10
    """When stdout is not a terminal (a log file), print one progress line every N steps
    (on a terminal: a progress bar). TensorBoard events are flushed as often."""
    log_level: str = "WARNING"
    """Python logging of every rank (megatron-core's, torch's), bare or under torchrun: records
    at this level and above, one line each on stderr prefixed with the rank. INFO adds
    megatron-core's setup notes (DDP buckets and their parameters, the optimizer config),
    DEBUG everything. ldt's own lines (rank map, progress, summary) are not logging."""
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
    estimate_memory: Optional[bool] = None
    """Estimate every rank's memory before anything starts (``ldt.memory``: the model's real
    chunks on fake tensors, seconds at any size) and print it with the rank map; a stage whose
    estimate exceeds its ``memory_gib`` is refused. None: when some stage states
    ``memory_gib``."""
    boundary_noise: float = 0.0
    """Privacy defence, off by default (0). Data-owning stages (the U-shape's edge) add Gaussian
    noise to every tensor they send across a stage boundary (activations to the cloud, gradients
    back at the wraparound); its standard deviation is this many times the RMS of the tensor
    sent (one message: seq x micro-batch x hidden values), so 1.0 means noise as strong as the
    signal. ``ldt-audit`` measures what it buys and costs (docs/privacy.md)."""

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):  # TrainConfig(**plain_dict), as tests build it
            self.optimizer = OptimizerSettings(**self.optimizer)
        at_least("train", self, "steps", 1, "set train.steps to the number of optimizer steps")
        at_least("train", self, "lr", 0, "a typical value is 1e-4 to 1e-3")
        at_least("train", self, "min_lr", 0, "the cosine decay ends at min_lr (0 is allowed)")
        at_least("train", self, "warmup_steps", 0, "0 starts at the full learning rate")
        at_least("train", self, "weight_decay", 0, "0 disables weight decay")
        at_least("train", self, "clip_grad", 0, "0 disables gradient clipping")
        at_least("train", self, "save_every", 0, "0 never writes a checkpoint")
        at_least("train", self, "keep_last", 0, "0 keeps every checkpoint")
        at_least("train", self, "snapshot_every", 1, "1 snapshots after every step")
        at_least("train", self, "log_interval", 1, "1 reports every step")
        at_least("train", self, "boundary_noise", 0, "0 turns the noise off")
        at_least("train", self, "ddp_bucket_size", 1, "None leaves it to megatron's DDP")
        if self.ddp_bucket_size is not None and self.overlap_grad_reduce is False:
            raise ConfigError(  # megatron's DDP reduces in one bucket then, whatever the size
                f"train.ddp_bucket_size={self.ddp_bucket_size} sizes the buckets of an "
                "overlapped gradient reduce, and train.overlap_grad_reduce=false; give "
                "train.overlap_grad_reduce=true, or leave train.ddp_bucket_size out")
        if given(self.loss_scale) and self.loss_scale is not None and not (
                math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ConfigError(f"train.loss_scale={self.loss_scale} must be a finite number > 0, "
                              "or null for dynamic loss scaling")
        if given(self.initial_loss_scale) and self.initial_loss_scale is not None and not (
                math.isfinite(self.initial_loss_scale) and self.initial_loss_scale >= 1):
            raise ConfigError(f"train.initial_loss_scale={self.initial_loss_scale} must be a "
                              "finite number >= 1 (megatron's smallest scale), e.g. 65536")
        if given(self.comm_timeout_s) and not (math.isfinite(self.comm_timeout_s)
                                                 and 0 < self.comm_timeout_s <= MAX_TIMEOUT_S):
            raise ConfigError(
                f"train.comm_timeout_s={self.comm_timeout_s} must be a finite number of seconds "
                f"> 0, at most {MAX_TIMEOUT_S:g} (a year): a dead rank stops the others after "
                "this long; e.g. 60")
        if given(self.lr, self.min_lr) and self.min_lr > self.lr:
            raise ConfigError(
                f"train.min_lr={self.min_lr} > train.lr={self.lr}: the schedule decays from lr "
                f"down to min_lr; set train.min_lr <= {self.lr}")
        for device, peak in (self.peak_tflops if given(self.peak_tflops) else {}).items():
            if not (math.isfinite(peak) and peak >= 0):
                raise ConfigError(f"train.peak_tflops.{device}={peak} must be a finite number "
                                  ">= 0 (TFLOP/s of one device; 0: unknown, no mfu)")
        if given(self.seed) and not 0 <= self.seed < 2**32:
            raise ConfigError(f"train.seed={self.seed} must be in [0, 2**32); e.g. 1234")
        if given(self.log_level) and str(self.log_level).upper() not in LOG_LEVELS:
            raise ConfigError(f"train.log_level={self.log_level!r} is not a logging level; use "
                              f"one of {', '.join(LOG_LEVELS)} (INFO shows megatron-core's)")


@dataclass
class DataConfig:
    path: Optional[str] = None
    """A text file to train on; None uses a corpus every machine has (Python's own sources)."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of the corpus."""
    tokenizer: str = "bytes"
    """``bytes`` (a token per byte, vocabulary 256) or the local path of a Hugging Face
    tokenizer (a ``tokenizer.json`` or a folder ``AutoTokenizer`` loads); never downloaded.
    With ``blend``: the tokenizer the data was preprocessed with (checked against
    ``model.vocab_size``). Only the data stages load it."""
    blend: Optional[Any] = None
    """Megatron indexed datasets to train on, as Megatron's ``--data-path``: ``PREFIX``,
    ``[PREFIX1, PREFIX2]`` or ``[W1, PREFIX1, W2, PREFIX2]`` (``ldt-preprocess`` writes
    ``PREFIX.bin`` + ``PREFIX.idx``). None: bytes of ``path`` / the built-in corpus."""
    split: str = "969,30,1"
    """Train, validation, test shares of each dataset's documents (``train.eval_every`` reads
    the validation split; the test split is never read)."""
    cache_dir: Optional[str] = None
    """Where megatron-core caches its sample indices (global rank 0 writes them; data ranks on
    other hosts build theirs in memory). None: ``$XDG_CACHE_HOME/ldt/indices`` (~/.cache)."""

    def __post_init__(self) -> None:
        at_least("data", self, "max_bytes", 1, "it caps how much of the corpus is read")


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
    cs.store(group="train/optimizer", name="base_optimizer", node=OptimizerSettings)


def _ref(schema: type) -> str:
    """Where a user finds a group's keys (named by refusals of an unknown key)."""
    return f"{config_load.fields_file(schema)} or `ldt-train --cfg job`"


def _to(schema: type, group: str, obj: Any) -> Any:
    """``obj`` as ``schema``: itself when it is one, else typed from a dict or a DictConfig
    (tests and the API pass dicts) by the one loader, naming a wrong field."""
    if isinstance(obj, schema):
        return obj
    return typed(schema, obj, group, ref=_ref(schema))


def to_cluster(obj: Any) -> ClusterConfig:
    return _to(ClusterConfig, "cluster", obj)


def to_model(obj: Any) -> ModelConfig:
    return _to(ModelConfig, "model", obj)


def to_train(obj: Any) -> TrainConfig:
    return _to(TrainConfig, "train", obj)


def to_data(obj: Any) -> DataConfig:
    return _to(DataConfig, "data", {} if obj is None else obj)


def typed_config(cfg) -> LdtConfig:
    """The resolved config as the :class:`~ldt.config.LdtConfig` every process of a run
    receives (picklable); a plain dict (tests, the API, ``python -m`` tools) is typed here, once,
    by config's own converters, naming a wrong field. An LdtConfig is returned as it is.
    """
    if isinstance(cfg, LdtConfig):
        return cfg
    return LdtConfig(cluster=to_cluster(cfg["cluster"]), model=to_model(cfg["model"]),
                     train=to_train(cfg["train"]), data=to_data(cfg.get("data")),
                     run_dir=cfg.get("run_dir", LdtConfig.run_dir))


def load_cluster_yaml(path: str) -> ClusterConfig:
    """Load a cluster file (as written by users or ``ldt-plan``), with type checking."""
    return load_typed(ClusterConfig, path, "cluster", "cluster file", ref=_ref(ClusterConfig))


def unknown_key(key: str, value: str = "") -> Optional[str]:
    """Why the dotted config ``key`` (a command-line override's, e.g. ``train.stepz``, with its
    ``value``) is not in the schema, naming the closest key that is, in one line; None when it
    is (or lies below a field that takes any key: ``train.peak_tflops.*``, ``data.blend``,
    ``cluster.link_delay_ms``)."""
    return config_load.unknown_key(LdtConfig, key, value, ref=_ref(LdtConfig))
