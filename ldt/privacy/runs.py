"""The runs an audit makes, all real U-shape training runs of the user's config, in one world.

- ``victim``: the edge trains on its own data for N steps (with ``train.audit_comm`` on, so
  the report lists what crossed); ``victim_noise_<s>``: the same with
  ``train.boundary_noise=s``. Their captures are what the cloud held; their losses are the
  defence's cost.
- ``shadow_known``: the cloud's own text through the same starting weights (same
  ``train.seed``, or the same checkpoint), learning rate 0, so every step sees those weights:
  the probe's training data when the edge's weights are known.
- ``shadow_unknown``: the same through a differently seeded model: the cloud's best guess
  when it does not know the edge's weights.

All runs go through ``ldt.training.loop.train_worker`` with :func:`capture_observers`, so
what is attacked is what the boundary transport carried. The world is local (127.0.0.1):
nothing leaves the machine.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Optional

import torch

from ldt.config import typed_config
from ldt.data.bytes import TextData
from ldt.data.bytes import default_corpus_files
from ldt.data.bytes import load_bytes
from ldt.launch import local
from ldt.plan.zb_prices import run_prices
from ldt.privacy.attacks import Vectors
from ldt.privacy.capture import capture_observers, channel_name, load_channel
from ldt.schedule.zerobubble import Priced
from ldt.storage.checkpoint_files import latest
from ldt.training.loop import train_worker


@dataclass
class Run:
    name: str
    cfg: dict
    run_dir: str
    noise: float = 0.0
    shadow: bool = False
    priced: Optional[Priced] = None
    """``train.schedule=zb``: the order's prices, made once here as ldt-train's launcher
    makes them (:func:`ldt.job.prepare.check`), handed to every rank."""


def plan_runs(cfg: dict, out: str, *, steps: int, noise_levels, cloud_text: str,
              shadow_tokens: int, checkpoint: Optional[str] = None) -> list[Run]:
    """Every run of one audit (plain-dict configs, as ldt-train's workers take them)."""
    first = _first_step(checkpoint)
    train = cfg["train"]
    tokens_per_step = train["num_microbatches"] * train["micro_batch_size"] * \
        cfg["model"]["seq_length"]
    shadow_steps = max(1, math.ceil(shadow_tokens / tokens_per_step))

    def variant(name: str, *, data_path=None, resume=checkpoint, n=steps, **train_changes) -> Run:
        c = copy.deepcopy(cfg)
        c["train"].update(steps=first + n if resume else n, resume=resume, verify=False,
                          audit_comm=False, save_every=0, check_finite=None, eval_every=0,
                          boundary_noise=0.0)
        c["train"].update(train_changes)
        if data_path is not None:
            c["data"]["path"] = data_path
        run_dir = os.path.join(out, name)
        c["run_dir"] = run_dir
        typed = typed_config(c)
        priced = (run_prices(typed.cluster, typed.model, typed.train)
                  if typed.train.schedule == "zb" else None)
        return Run(name, c, run_dir, noise=c["train"]["boundary_noise"],
                   shadow=data_path is not None, priced=priced)

    total = first + steps if checkpoint else steps
    runs = [variant("victim", audit_comm=True, eval_every=total)]
    runs += [variant(f"victim_noise_{s:g}", boundary_noise=float(s), eval_every=total)
             for s in noise_levels if s > 0]
    frozen = dict(lr=0.0, min_lr=0.0, n=shadow_steps, data_path=cloud_text)
    runs.append(variant("shadow_known", **frozen))
    runs.append(variant("shadow_unknown", resume=None, seed=train["seed"] + 1, **frozen))
    return runs


def _first_step(checkpoint: Optional[str]) -> int:
    if checkpoint is None:
        return 0

    found = latest(checkpoint)
    if found is None:
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no complete checkpoint there; give "
                                "a run folder with checkpoints/ or a checkpoints/step_N folder")
    return int(open(os.path.join(found, "COMPLETE")).read().strip()) + 1


def audit_worker(rank: int, world: int, runs: list[Run]) -> list[Optional[dict]]:
    """One rank of the audit's world: every run in turn, each captured at its boundaries."""
    return [train_worker(rank, world, r.cfg, r.run_dir, observe=capture_observers,
                         priced=r.priced) for r in runs]


def run_all(runs: list[Run], world_size: int, timeout_s: float) -> dict[str, dict]:
    """Run them (one local world); the summary of each run by name."""

    for r in runs:
        if os.path.exists(os.path.join(r.run_dir, "capture")):
            raise FileExistsError(f"{r.run_dir} holds an earlier capture; give a new --out")
    results = local.run_local_world(world_size, audit_worker, (runs,), timeout_s=timeout_s,
                              comm_timeout_s=runs[0].cfg["train"]["comm_timeout_s"])
    summaries = next(res for res in results if res[0] is not None)
    return {r.name: s for r, s in zip(runs, summaries)}


# ---- the cloud's own text ----------------------------------------------------------------
def default_cloud_files() -> list[str]:
    """Python sources in the standard library's sub-packages (asyncio/, email/, json/, ...):
    the same language as the default edge corpus (the top-level ``*.py``, see
    :mod:`ldt.data.bytes`) but not one file of it. Test suites are left out."""
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", "dist-packages", "test", "tests", "idle_test")
    return sorted(f for f in glob.glob(os.path.join(stdlib, "*", "**", "*.py"), recursive=True)
                  if not any(part in skip for part in os.path.relpath(f, stdlib).split(os.sep)))


def write_cloud_text(path: str, max_bytes: int) -> str:
    edge = set(default_corpus_files())
    parts, total = [], 0
    for name in default_cloud_files():
        if name in edge:  # a guard: sub-package files are never top-level ones
            continue
        with open(name, "rb") as f:
            parts.append(f.read(max_bytes - total))
        total += len(parts[-1])
        if total >= max_bytes:
            break
    with open(path, "wb") as f:
        f.write(b"".join(parts))
    return path


def text_tokens(path: str, max_bytes: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(load_bytes(path, max_bytes)), dtype=torch.uint8).long()


# ---- captured tensors as token vectors, with the truth the edge knows ---------------------
def forward_channels(num_stages: int) -> list[tuple[str, str]]:
    """(label, channel) of every forward boundary the cloud holds: what the edge sent to the
    first cloud stage (received there), then each cloud stage's output (sent by it)."""
    out = [("0->1 activation", channel_name("recv", 0, 1, "F"))]
    for s in range(1, num_stages):
        out.append((f"{s}->{(s + 1) % num_stages} activation",
                    channel_name("sent", s, (s + 1) % num_stages, "F")))
    return out


def wraparound_channel(num_stages: int) -> tuple[str, str]:
    """The gradients the edge returns to the last cloud stage (the end chunk's input grad)."""
    last = num_stages - 1
    return f"0->{last} gradient", channel_name("recv", 0, last, "B")


def boundary_vectors(run: Run, channel: str, *, gradient: bool) -> tuple[Vectors, torch.Tensor]:
    """A run's training messages on ``channel`` as token vectors, and their true tokens
    (inputs for activations, labels for gradients), read from the data the run trained on.

    Gradients are multiplied by the tokens per step (micro-batch x sequence x micro-batches,
    all visible to the cloud in the messages), so runs of other batch shapes compare."""
    c = run.cfg
    t, seq = c["train"], c["model"]["seq_length"]
    m = t["num_microbatches"]
    ch = load_channel(run.run_dir, channel)
    data = TextData(c["data"]["path"], seq, t["micro_batch_size"], m, dp_rank=0,
                    dp=c["cluster"].get("dp", 1), seed=t["seed"], max_bytes=c["data"]["max_bytes"],
                    vocab_size=c["model"]["vocab_size"])
    xs, truth, steps = [], [], []
    for tensor, step, index in zip(ch.tensors, ch.steps.tolist(), ch.indices.tolist()):
        if index >= m:  # an evaluation pass's message
            continue
        batch = data.batch(step, index)["labels" if gradient else "tokens"]  # [mbs, seq]
        x = tensor.permute(1, 0, 2).reshape(-1, tensor.shape[-1])  # sequences in order
        xs.append(x * (tensor.shape[0] * tensor.shape[1] * m) if gradient else x)
        truth.append(batch.reshape(-1))
        steps.append(torch.full((batch.numel(),), step))
    if not xs:
        raise ValueError(f"{run.run_dir}: no training message on {channel}")
    x = torch.cat(xs).float()
    positions = torch.arange(seq).repeat(len(x) // seq)
    return Vectors(x, torch.cat(steps), positions, seq), torch.cat(truth)


def same_on_both_sides(run: Run, num_stages: int) -> dict[str, bool]:
    """Did the cloud receive bit for bit what the edge sent? (edge's sends vs cloud's receives)"""
    last = num_stages - 1
    out = {}
    for src, dst, d in ((0, 1, "F"), (0, last, "B")):
        sent = load_channel(run.run_dir, channel_name("sent", src, dst, d)).tensors
        received = load_channel(run.run_dir, channel_name("recv", src, dst, d)).tensors
        out[f"{src}->{dst} {'activation' if d == 'F' else 'gradient'}"] = bool(
            sent.shape == received.shape and torch.equal(sent, received))
    return out
