"""The memory estimate as a user sees it: a per-stage table, and the one-line refusal.

The refusal names the stage, the estimate, the limit, the largest component and the levers
that would bring it down, most effective first where the estimate can tell: recomputation on
that stage (activations), more TP (everything on the stage but the data-parallel copies),
the distributed optimizer (main params and optimizer states, when the stage has replicas to
shard over), fewer micro-batches in flight (prefetch, stages after it, the micro-batch size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ldt import memory
from ldt.config import to_train
from ldt.memory import GIB, StageEstimate
from ldt.storage.snapshot_files import GENERATIONS
from ldt.topology.buddies import copy_holders

# snapshots of a rank's state in host memory at once: GENERATIONS in files, and no buffer
# beside them: the next one is copied (or received) straight into the oldest's file, mapped
# (ldt.storage.snapshot_files.MappedFiles)
SNAPSHOTS_HELD = GENERATIONS

MIB = 2**20


def _unit(stages: list[StageEstimate]) -> tuple[float, str]:
    return (GIB, "GiB") if max(s.peak for s in stages) >= GIB else (MIB, "MiB")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def table(stages: list[StageEstimate]) -> str:
    """Per stage (every rank of a stage holds the same): each component and the peak."""
    div, unit = _unit(stages)
    split = any(s.wstore for s in stages)  # train.schedule=zb: the W store's column
    head = ("stage", "ranks", "tp", "recompute", "weights", "grads", "main", "optim",
            "act/mb x in flight", "buffers", *(("W store/mb x held",) if split else ()),
            "transient", "peak", "limit")
    rows = [head]
    for s in stages:
        acts = " + ".join(f"{a / div:.2f}x{n}" for a, n in zip(s.activations, s.inflight))
        wstore = " + ".join(f"{w / div:.2f}x{n}" for w, n in zip(s.wstore, s.wstore_held))
        rows.append((
            f"{s.index}:{s.name}", _ranks(s.ranks), str(s.tp), s.recompute,
            *(f"{v / div:.2f}" for v in (s.weights, s.grads, s.main_params, s.optimizer)),
            acts, f"{s.buffer_bytes / div:.2f}", *((wstore,) if split else ()),
            f"{s.peak_transient / div:.2f}",
            f"{s.peak / div:.2f}" + ("" if s.fits else " !"),
            "-" if s.limit is None else f"{s.limit / div:.2f}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    attention = sorted({s.attention for s in stages})
    lines.append(f"memory per rank, {unit} (estimate: the stages' real chunks on fake tensors, "
                 f"two micro-batches through megatron-core; attention {'/'.join(attention)}); "
                 "'!' exceeds the stage's memory_gib")
    return "\n".join(lines)


def snapshot_line(stages: list[StageEstimate], train) -> Optional[str]:
    """With ``train.snapshot_dir``: the host memory each stage's ranks keep for snapshots
    (:data:`SNAPSHOTS_HELD` of its state; device memory above is not affected); else None."""
    if not train.snapshot_dir:
        return None
    per_stage = ", ".join(f"{s.index}:{s.name} {_size(SNAPSHOTS_HELD * s.snapshot_bytes)}"
                          for s in stages)
    return (f"train.snapshot_dir={train.snapshot_dir}: host memory per rank for snapshots, "
            f"{SNAPSHOTS_HELD} x the rank's state (in files; the next is copied into the "
            f"oldest's): {per_stage}")


@dataclass(frozen=True)
class Hosts:
    """Which host each rank runs on (an elastic world's plan): ``nodes`` by rank, the data
    owner's node (None: none), and each node's available host memory in GiB (None: unknown)."""

    nodes: tuple[str, ...]
    owner: Optional[str]
    available_gib: dict
    send_s: Optional[Callable[[str, str, int], float]] = None
    """Seconds to send so many bytes from one node to another (the inventory's link), for
    pricing the copies; None: not priced."""
    step_s: Optional[float] = None
    """The planned step time the copies overlap."""


def host_snapshots(stages: list[StageEstimate], topo, hosts: Hosts,
                   sharded: bool) -> dict[str, tuple[int, int]]:
    """Per node: the host memory its ranks' own snapshots take, and the copies it keeps for
    ranks of other hosts (:func:`ldt.topology.buddies.copy_holders`), each
    :data:`SNAPSHOTS_HELD` generations of the writer's state."""
    held = {r: SNAPSHOTS_HELD * s.snapshot_bytes for s in stages for r in s.ranks}
    own = {n: 0 for n in hosts.nodes}
    copies = {n: 0 for n in hosts.nodes}
    for rank, node in enumerate(hosts.nodes):
        own[node] += held[rank]
    for writer, holder in copy_holders(topo, list(hosts.nodes), hosts.owner, sharded).items():
        copies[hosts.nodes[holder]] += held[writer]
    return {n: (own[n], copies[n]) for n in own}


def copy_line(stages: list[StageEstimate], topo, hosts: Hosts, sharded: bool,
              every: int = 1) -> Optional[str]:
    """The copies' traffic per snapshot between each pair of nodes, priced on the inventory's
    links, against the planned steps they overlap (``every``: ``train.snapshot_every``); None
    when nothing is copied or priced. A copy slower than that makes the writers busy and the
    ranks skip snapshots together."""
    if hosts.send_s is None:
        return None
    one = {r: s.snapshot_bytes for s in stages for r in s.ranks}
    pairs: dict[tuple[str, str], int] = {}
    for writer, holder in copy_holders(topo, list(hosts.nodes), hosts.owner, sharded).items():
        key = (hosts.nodes[writer], hosts.nodes[holder])
        pairs[key] = pairs.get(key, 0) + one[writer]
    if not pairs:
        return None
    priced = {key: hosts.send_s(*key, nbytes) for key, nbytes in pairs.items()}
    when = "per step" if every == 1 else f"every {every} steps"
    text = f"snapshot copies {when} (the inventory's links): " + ", ".join(
        f"node {a} -> {b} {_size(pairs[(a, b)])} {priced[(a, b)] * 1e3:.1f} ms"
        for a, b in sorted(pairs))
    if hosts.step_s:
        steps = "a planned step" if every == 1 else f"{every} planned steps"
        text += f", against {steps} of {hosts.step_s * 1e3:.1f} ms"
        slow = sorted(key for key, t in priced.items() if t > hosts.step_s * every)
        if slow:
            text += (f"; slower than {'a step' if every == 1 else f'{every} steps'} "
                     f"({', '.join(f'{a} -> {b}' for a, b in slow)}): "
                     "snapshots will be skipped on the steps a copy is still travelling")
    return text


def host_lines(per_host: dict[str, tuple[int, int]], hosts: Hosts) -> tuple[str, Optional[str]]:
    """The snapshots' host memory per node, and the one-line refusal of the first node
    without room for them (None when every node has, or its memory is unknown)."""
    text = "host memory per node for snapshots (own + copies kept for other hosts): " + \
        ", ".join(f"node {n} {_size(own)} + {_size(copies)}"
                  for n, (own, copies) in sorted(per_host.items()))
    for node, (own, copies) in sorted(per_host.items()):
        have = hosts.available_gib.get(node)
        if have is not None and own + copies > have * GIB:
            return text, (
                f"node {node} would keep {_size(own + copies)} of snapshots in host memory "
                f"({_size(own)} of its own ranks, {_size(copies)} of copies for ranks of other "
                f"hosts) but had {have:.2f} GiB available at its start; set "
                "train.snapshot_dir=null (disk checkpoints only) or give that host more memory")
    return text, None


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


def refusal(stage: StageEstimate, topo, train) -> str:
    """One line: the stage, estimate, limit, largest component, the levers."""
    parts = stage.components()
    largest = max(parts, key=parts.get)
    what = f"{largest} {_size(parts[largest])}"
    if largest == "activations":
        what += " (" + " + ".join(
            f"{n} micro-batch{'es' if n != 1 else ''} x {_size(a)}"
            for a, n in zip(stage.activations, stage.inflight)) + " in flight)"
    where = f"cluster.stages[{stage.index}]"
    levers = []
    if not stage.recompute.startswith("full"):
        levers.append(f"recompute that stage ({where}.recompute.granularity="
                      + ("full with method uniform, num_layers 1" if stage.recompute != "-"
                         else "selective, or full with method uniform, num_layers 1") + ")")
    levers.append(f"more TP ({where}.tp={2 * stage.tp})")
    if stage.dp > 1 and not stage.distributed_optimizer:
        levers.append("the distributed optimizer (train.distributed_optimizer=true)")
    fewer = ["a smaller train.micro_batch_size"]
    if getattr(train, "prefetch", 0):
        fewer.insert(0, f"train.prefetch < {train.prefetch}")
    if topo.u_shape and stage.index == 0 or not topo.u_shape and stage.index < topo.num_stages - 1:
        fewer.insert(0, "fewer stages after it")
    levers.append("fewer micro-batches in flight (" + ", ".join(fewer) + ")")
    return (f"stage {stage.index} ({stage.name}, ranks {_ranks(stage.ranks)}) needs "
            f"{_size(stage.peak)} per rank (estimate) but {where}.memory_gib="
            f"{stage.limit / GIB:g}; the largest part is {what}; levers: " + "; ".join(levers))


def check(cfg: dict, topo, hosts: Optional[Hosts] = None,
          stages: Optional[list[StageEstimate]] = None) -> tuple[str, str | None]:
    """Estimate a validated config (``ldt-train``'s pre-flight): ``(table, refusal)``, the
    refusal (of the first stage that does not fit, else of the first host without room for
    its snapshots: ``hosts``, an elastic world's) None when everything fits. ``stages``: the
    estimate made already (in the caller's process, :func:`ldt.memory.stages.estimate_here`);
    else it is made in a helper (:func:`ldt.memory.estimate`)."""
    stages = memory.estimate(cfg) if stages is None else stages
    train = to_train(cfg["train"])
    over = next((s for s in stages if not s.fits), None)
    lines = [table(stages), snapshot_line(stages, train)]
    refused = None if over is None else refusal(over, topo, train)
    if hosts is not None and train.snapshot_dir:
        sharded = train.distributed_optimizer
        text, host_refused = host_lines(host_snapshots(stages, topo, hosts, sharded), hosts)
        lines += [text, copy_line(stages, topo, hosts, sharded, train.snapshot_every)]
        refused = refused or host_refused
    return "\n".join(filter(None, lines)), refused
