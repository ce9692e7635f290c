"""``ldt-audit``'s library: play the honest-but-curious cloud against a real U-shape run.

:func:`audit` makes the runs of :mod:`ldt.privacy.runs` (one local world), then attacks what
the cloud held in each victim run with :mod:`ldt.privacy.attacks` and returns the report:
what crossed (from ``train.audit_comm``), whether the cloud's capture equals what the edge
sent, one row per (run, tensor, attack) with the recovery rate and the chance level, and the
loss of each victim run (the defence's cost). :func:`format_report` prints it as tables.

Recovery is scored per token vector against the edge's true tokens (inputs for activations,
next-token labels for gradients) over every training step captured, and for the first and
the last step apart (the weights move while the edge trains). Chance is the share of the most
frequent true token (guessing it every time), or 0.5 for an AUC.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from ldt.boundary.noise import BoundaryNoise
from ldt.config import ConfigError
from ldt.config import to_model
from ldt.config.userfiles import require
from ldt.data.bytes import min_corpus_bytes
from ldt.job.hydra import compose
from ldt.job.train import prepare
from ldt.models.tensor_files import check_compatible
from ldt.privacy import attacks as A
from ldt.privacy import runs as R
from ldt.schedule.size import check_fits
from ldt.storage.atomic import new_folder
from ldt.storage.checkpoint_files import preflight

KNOWN, TRACKED, UNKNOWN, NONE = ("edge weights known", "weights known at start, tracked",
                                 "edge weights unknown", "no weights needed")


@dataclass
class AuditOptions:
    overrides: list = field(default_factory=list)
    """Hydra overrides, as for ldt-train (cluster=..., model=..., train.*, data.*)."""
    out: str = "outputs/audit"
    steps: Optional[int] = None
    """Training steps of each victim run (default: train.steps)."""
    noise_levels: tuple = (1.0, 2.0, 4.0)
    """train.boundary_noise settings to measure besides 0."""
    checkpoint: Optional[str] = None
    """Start every run but ``shadow_unknown`` from this checkpoint (a run folder or step)."""
    cloud_text: Optional[str] = None
    """The cloud's own text (default: the standard library's sub-packages' sources)."""
    cloud_text_bytes: int = 2_000_000
    shadow_tokens: int = 24_576
    """Token vectors in each shadow run (the probes' training data)."""
    clusters: int = 64
    timeout_s: float = 1800.0
    overwrite: bool = False
    """Replace an existing ``out`` folder whole (default: refuse one that holds anything)."""
    json: Optional[str] = None
    """Also write the report here, as JSON; inside ``out`` it is part of the folder."""


def audit(opts: AuditOptions, log=print) -> dict:
    """Check every option, then make the runs and attack them in a folder built beside
    ``opts.out`` and renamed into place when the report is complete: a refused or failed
    audit leaves ``out`` as it was."""
    cfg, checked = prepare(compose(opts.overrides), opts.out)  # as ldt-train validates
    topo = checked.topo
    steps = opts.steps or cfg["train"]["steps"]
    check_options(opts, cfg, topo, steps)
    inputs = [(f, p) for f, p in (("--cloud-text", opts.cloud_text),
                                  ("--checkpoint", opts.checkpoint)) if p]
    with new_folder(opts.out, flag="--out", overwrite=opts.overwrite, inputs=inputs) as work:
        report = _audit(opts, cfg, topo, steps, work, log)
        final = os.path.abspath(opts.out)
        if report["config"]["cloud_text"].startswith(work + os.sep):
            report["config"]["cloud_text"] = final + report["config"]["cloud_text"][len(work):]
        if opts.json and _inside(os.path.abspath(opts.json), final):
            path = os.path.join(work, os.path.relpath(os.path.abspath(opts.json), final))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    return report


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_options(opts: AuditOptions, cfg: dict, topo, steps: int) -> None:
    """Every option against the config, before a run starts: a setting that would make a
    measurement meaningless, or that this machine cannot hold, is refused in one line."""
    if not topo.u_shape:
        raise ConfigError("ldt-audit measures what the cloud of a U-shape learns; the cluster "
                          "has cluster.u_shape=false: use a U-shape cluster (e.g. cpu_demo)")
    if cfg["data"].get("blend") is not None:
        raise ConfigError("ldt-audit reads the edge's true tokens from byte data (data.path or "
                          "the built-in corpus); data.blend (indexed datasets) is not supported "
                          "yet: audit with data.path=<a text file of the same kind>")
    train, model = cfg["train"], cfg["model"]
    for flag, value, low in (("--steps", steps, 1), ("--shadow-tokens", opts.shadow_tokens, 1),
                             ("--clusters", opts.clusters, 2)):
        if value < low:
            raise ConfigError(f"{flag}={value} must be >= {low}")
    for level in opts.noise_levels:
        if not math.isfinite(level) or level <= 0:
            raise ConfigError(f"--noise {level}: give finite settings > 0 (0 is always "
                              "measured)")
    vectors = steps * train["num_microbatches"] * train["micro_batch_size"] * model["seq_length"]
    if opts.clusters > vectors:
        raise ConfigError(f"--clusters={opts.clusters} exceeds the {vectors} token vectors a "
                          f"victim run captures (--steps {steps}): every vector would be its own "
                          f"cluster, a meaningless recovery; use at most {vectors}, or more "
                          "--steps")
    if opts.cloud_text is not None:
        text = opts.cloud_text

        require(text, f"--cloud-text {text}", "file", "give a text file of the cloud's own (or "
                "leave it out for the built-in one)")
        least = min_corpus_bytes(model["seq_length"], train["micro_batch_size"])
        if os.path.getsize(text) < least:
            raise ConfigError(f"--cloud-text {text} has {os.path.getsize(text)} bytes; the "
                              f"shadow runs need at least {least} (sequences of "
                              f"{model['seq_length']}, 1/20 held out): give a larger file")
    if opts.checkpoint is not None:
        preflight(opts.checkpoint, "--checkpoint", hashes=True)

        check_compatible(opts.checkpoint, to_model(model))  # the runs start from it
    # every captured token vector is float32 of the hidden size, loaded in full per channel
    # (victim, two shadows; the attacks copy it about three times) on the capturing host
    row = 4 * model["hidden_size"] * 3
    channels = topo.num_stages + 1
    check_fits("--steps", steps, channels * vectors * row + 4 * vectors * opts.clusters,
               f"the captures of {vectors} token vectors per channel and their clustering",
               unit_bytes=(channels * row + 4 * opts.clusters) * vectors / steps)
    check_fits("--shadow-tokens", opts.shadow_tokens, 2 * channels * opts.shadow_tokens * row,
               "the two shadow runs' captures", unit_bytes=2 * channels * row)


def _audit(opts: AuditOptions, cfg: dict, topo, steps: int, out: str, log) -> dict:
    """The runs and the attacks, in the folder ``out``."""
    cloud_text = opts.cloud_text or R.write_cloud_text(
        os.path.join(out, "cloud_text.txt"), opts.cloud_text_bytes)
    runs = R.plan_runs(cfg, out, steps=steps,
                       noise_levels=opts.noise_levels, cloud_text=cloud_text,
                       shadow_tokens=opts.shadow_tokens, checkpoint=opts.checkpoint)
    log(f"ldt-audit: {len(runs)} runs of {topo.num_stages} stages "
        f"({', '.join(r.name for r in runs)}) in {opts.out}")
    start = time.perf_counter()
    summaries = R.run_all(runs, topo.world_size, opts.timeout_s)
    log(f"ldt-audit: runs done in {time.perf_counter() - start:.0f} s")
    by_name = {r.name: r for r in runs}
    victims = [r for r in runs if not r.shadow]
    lang = A.Language.of(R.text_tokens(cloud_text, opts.cloud_text_bytes))
    rows = []
    for run in victims:
        start = time.perf_counter()
        rows += attack_run(run, by_name["shadow_known"], by_name["shadow_unknown"], lang,
                           topo.num_stages, deep=run.noise == 0, clusters=opts.clusters)
        log(f"ldt-audit: attacked {run.name} in {time.perf_counter() - start:.0f} s")
    return {
        "config": {"overrides": list(opts.overrides), "steps": steps,
                   "checkpoint": opts.checkpoint, "cloud_text": cloud_text,
                   "seed": cfg["train"]["seed"], "layout": topo.split.to_layout_string(),
                   "model": cfg["model"]["name"]},
        "crossed": crossed(by_name["victim"].run_dir),
        "other_messages": other_messages(by_name["victim"].run_dir),
        "capture_equals_sent": {r.name: R.same_on_both_sides(r, topo.num_stages)
                                for r in victims},
        "losses": [loss_row(r, summaries[r.name]) for r in victims],
        "rows": rows,
    }


def attack_run(run: R.Run, known: R.Run, unknown: R.Run, lang: A.Language, num_stages: int,
               *, deep: bool, clusters: int) -> list[dict]:
    """Every attack on one victim run. ``deep``: also the cloud's own deeper boundaries."""
    rows = []
    forward = R.forward_channels(num_stages)
    for label, channel in forward if deep else forward[:1]:
        rows += _attack(run, known, unknown, lang, label, channel, gradient=False,
                        clusters=clusters)
    label, channel = R.wraparound_channel(num_stages)
    rows += _attack(run, known, unknown, lang, label, channel, gradient=True, clusters=clusters)
    return rows


def _attack(run, known, unknown, lang, tensor: str, channel: str, *, gradient: bool,
            clusters: int) -> list[dict]:
    victim, truth = R.boundary_vectors(run, channel, gradient=gradient)
    shadow, shadow_truth = _as_sent(R.boundary_vectors(known, channel, gradient=gradient), run)
    other, other_truth = _as_sent(R.boundary_vectors(unknown, channel, gradient=gradient), run)
    what = "label" if gradient else "input"
    row = _scorer(run, tensor, victim, truth)
    probe = A.fit_probe(shadow.x, shadow_truth)
    out = []
    if gradient:
        top = int(lang.tokens[0])
        out.append(row(f"{what}: gradient norm (Li et al.)", NONE,
                       auc=lambda x, t: A.norm_auc(x, t, top),
                       note=f"AUC of 'label is {_show(top)}' (the cloud's most frequent token)"))
        out.append(row(f"{what}: gradient direction (Li et al.)", KNOWN,
                       A.nearest_direction(shadow.x, shadow_truth, victim.x)))
    out.append(row(f"{what}: linear probe", KNOWN, probe.predict(victim.x)))
    out.append(row(f"{what}: linear probe, self-trained along", TRACKED, A.track(probe, victim)))
    out.append(row(f"{what}: linear probe of another init", UNKNOWN,
                   A.fit_probe(other.x, other_truth).predict(victim.x)))
    assign = A.cluster(victim, clusters)
    out.append(row(f"{what}: clusters + bigram decipherment", UNKNOWN,
                   A.decipher(assign, victim.seq_length, lang)))
    return out


def _as_sent(vectors_truth, run: R.Run):
    """The shadow's vectors as the victim run's edge would have sent them: the cloud knows
    the defence's setting (not its noise draws) and applies it to its own shadow data."""
    vectors, truth = vectors_truth
    if run.noise > 0:
        noise = BoundaryNoise(run.noise, seed=2024)  # the cloud's own draws
        per_message = run.cfg["train"]["micro_batch_size"] * vectors.seq_length
        noised = [noise(message, 0, 1, "F") for message in vectors.x.split(per_message)]
        vectors = A.Vectors(torch.cat(noised), vectors.step, vectors.position,
                            vectors.seq_length)
    return vectors, truth


def _scorer(run: R.Run, tensor: str, victim: A.Vectors, truth: torch.Tensor):
    steps = victim.step
    first, last = steps.min(), steps.max()
    chance = torch.bincount(truth).max().item() / len(truth)

    def row(attack: str, setting: str, guesses=None, *, auc=None, note: str = "") -> dict:
        if auc is not None:
            metric, score = "AUC", lambda m: auc(victim.x[m], truth[m])
            base = 0.5
        else:
            metric, base = "accuracy", chance
            hits = (guesses == truth).float()
            score = lambda m: float(hits[m].mean())  # noqa: E731
        everything = torch.ones_like(steps, dtype=torch.bool)
        return {"run": run.name, "boundary_noise": run.noise, "tensor": tensor,
                "attack": attack, "setting": setting, "metric": metric,
                "recovery": score(everything), "first_step": score(steps == first),
                "last_step": score(steps == last), "chance": base, "vectors": len(truth),
                **({"note": note} if note else {})}

    return row


def _show(token: int) -> str:
    return repr(chr(token)) if token < 128 else str(token)


def loss_row(run: R.Run, summary: dict) -> dict:
    losses = summary["losses"]
    tail = losses[-min(5, len(losses)):]
    return {"run": run.name, "boundary_noise": run.noise, "steps": len(losses),
            "first_loss": summary["first_loss"], "final_loss_last5": sum(tail) / len(tail),
            "eval_loss": summary.get("eval_loss")}


def crossed(run_dir: str) -> list[dict]:
    """What crossed each boundary per step, from the run's communication audit."""
    with open(os.path.join(run_dir, "comm_audit.jsonl")) as f:
        records = [json.loads(line) for line in f]
    per_step: dict[tuple, Counter] = {}
    for r in records:
        key = (r["src_stage"], r["dst_stage"], r["direction"], r["dtype"], tuple(r["shape"]),
               r["bytes"])
        per_step.setdefault(key, Counter())[r["step"]] += 1
    # the fewest messages in a step: a training step's (the last step also ran an evaluation)
    out = [{"src_stage": k[0], "dst_stage": k[1], "direction": k[2], "dtype": k[3],
            "shape": list(k[4]), "messages_per_step": min(c.values()),
            "bytes_per_step": min(c.values()) * k[5]} for k, c in per_step.items()]
    return sorted(out, key=lambda e: (e["direction"], e["src_stage"]))


def other_messages(run_dir: str) -> list[dict]:
    """What else the edge took part in across a boundary, from the communication audit's
    message tap (``comm_audit_messages.jsonl``): e.g. the gradient-norm all-reduce."""
    path = os.path.join(run_dir, "comm_audit_messages.jsonl")
    if not os.path.exists(path):
        return []
    seen: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") != "message" or r.get("stage") != 0 or not r.get("crosses_boundary"):
                continue
            payload = [f"{t['dtype']} {t['shape']}" for t in r.get("tensors", [])] + \
                [f"object {o}" for o in r.get("objects", [])]
            entry = seen.setdefault(f"{r['site']} {r['op']} {payload}", {
                "site": r["site"], "op": r["op"], "stages": r["group_stages"],
                "payload": payload, "messages": 0, "steps": set()})
            entry["messages"] += 1
            entry["steps"].add(r["step"])
    return [{**e, "steps": len(e["steps"])} for e in seen.values()]


def format_report(report: dict) -> str:
    lines = ["what crossed per step (train.audit_comm of the victim run):"]
    for c in report["crossed"]:
        who = "edge" if c["src_stage"] == 0 else f"stage {c['src_stage']}"
        lines.append(f"  {c['src_stage']}->{c['dst_stage']} {c['direction']:<10} {who:<8} "
                     f"{c['dtype']} {c['shape']}  x{c['messages_per_step']}")
    for m in report.get("other_messages", []):
        lines.append(f"  and {m['op']} over stages {m['stages']} ({m['site']}): "
                     f"{', '.join(m['payload'])}, {m['messages']} in {m['steps']} steps")
    same = [ok for run in report["capture_equals_sent"].values() for ok in run.values()]
    lines.append(f"the cloud's capture equals what the edge sent, bit for bit: "
                 f"{sum(same)} of {len(same)} channels x runs")
    lines.append("")
    head = (f"{'attack':<40} {'setting':<32} {'tensor':<16} {'noise':>5} {'metric':>8} "
            f"{'recovery':>8} {'first':>6} {'last':>6} {'chance':>6}")
    lines += [head, "-" * len(head)]
    for r in report["rows"]:
        lines.append(f"{r['attack']:<40} {r['setting']:<32} {r['tensor']:<16} "
                     f"{r['boundary_noise']:>5g} {r['metric']:>8} {r['recovery']:>8.3f} "
                     f"{r['first_step']:>6.3f} {r['last_step']:>6.3f} {r['chance']:>6.3f}")
    lines.append("")
    head = (f"{'train.boundary_noise':>20} {'final loss':>10} {'eval loss':>9} "
            f"{'input: all / first step':>23} {'label: all / first step':>23} {'chance':>6}")
    lines += ["the defence's trade-off (loss: mean of the last 5 steps; eval: held-out data; "
              "recovery: the best attack's, over all steps and in the first step alone):",
              head, "-" * len(head)]
    for loss in report["losses"]:
        ours = [r for r in report["rows"] if r["run"] == loss["run"]
                and r["tensor"].startswith("0->") and r["metric"] == "accuracy"]

        def best(what: str) -> str:
            mine = [r for r in ours if r["attack"].startswith(what)]
            if not mine:
                return "-"
            return (f"{max(r['recovery'] for r in mine):.3f} / "
                    f"{max(r['first_step'] for r in mine):.3f}")

        ev, chance = loss["eval_loss"], max((r["chance"] for r in ours), default=float("nan"))
        lines.append(f"{loss['boundary_noise']:>20g} {loss['final_loss_last5']:>10.4f} "
                     f"{ev if ev is None else format(ev, '.4f'):>9} {best('input'):>23} "
                     f"{best('label'):>23} {chance:>6.3f}")
    return "\n".join(lines)
