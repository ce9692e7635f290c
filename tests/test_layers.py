"""The house: ldt's modules import down the data flow of a step, never up, never in a circle.

Every module of the installed package (``ldt``, ``ldt.patches`` from ``patches/``, ``ldt.tools``
from ``tools/``) has a layer in :data:`LAYERS` (the longest matching prefix wins); an import,
at module level or inside a function, may only point to the same layer or a lower one. An
``if __name__ == "__main__":`` block is a command's entry, not a dependency, and is not counted
(``ldt-rankmap`` runs ``ldt.tools.rankmap`` that way). A module added without a layer
fails here: give it one.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = (("ldt", "ldt"), ("patches", "ldt.patches"), ("tools", "ldt.tools"))

# low -> high; the steps of the data flow, with what several of them use at the bottom
LAYERS = [
    # 0 foundation: config schema, layout grammar, device types, process launching, logging
    ["ldt", "ldt.config", "ldt.config.layout", "ldt.topology.device", "ldt.launch.quiet", "ldt.launch.progress",
     "ldt.launch.forkserver", "ldt.launch.local", "ldt.job.hydra", "ldt.job.hydra_guard",
     # reading a user's YAML / JSON, the one way ldt writes a file or a folder (and puts it
     # in place), and a run folder's lock
     "ldt.config.errors", "ldt.config.userfiles", "ldt.storage.atomic", "ldt.storage.commit",
     "ldt.storage.runlock"],
    # 1 topology: who is in which stage
    ["ldt.topology.ranks"],
    # 2 pure data and readers (no process groups): schedules as data, routing, the rank plan
    #   (every group and boundary route), the cost model
    #   and planner, model shapes, data files, checkpoint folders
    ["ldt.schedule", "ldt.topology.routes", "ldt.plan", "ldt.models.arch", "ldt.models.spec", "ldt.models.vocab",
     "ldt.models.recompute",
     "ldt.models.sharding", "ldt.data.bytes", "ldt.data.tokenizer", "ldt.data.files",
     "ldt.storage"],
    # 3 validation: every check before the first collective; an elastic world's plan
    ["ldt.topology.validate", "ldt.elastic"],
    # 4 groups: process groups, megatron-core's view of them, the patches that install it
    ["ldt.groups.parallel_state", "ldt.groups.cross_stage", "ldt.patches"],
    # 5 stage models and their data
    ["ldt.models", "ldt.data"],
    # 6 boundary transport
    ["ldt.boundary", "ldt.p2p"],
    # 7 the schedule's runtime (walks an action list over the boundary)
    ["ldt.pipeline.runtime", "ldt.pipeline.forward_backward", "ldt.patches.schedules"],
    # 8 one rank's job: optimizer, loop, checkpoints, observation; what runs on top of it
    ["ldt.training", "ldt.models.hf", "ldt.boundary.noise", "ldt.privacy.capture",
     "ldt.testing", "ldt.memory"],
    # 9 entry points
    ["ldt.job.train", "ldt.job.prepare", "ldt.job.elastic", "ldt.job.megatron", "ldt.privacy", "ldt.tools"],
]


def _modules() -> dict[str, str]:
    out = {}
    for folder, package in SOURCES:
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3]
                    name = ".".join([package, *rel.split(os.sep)])
                    out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _is_main_block(node) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name) and test.left.id == "__name__")


def _imports(name: str, path: str, modules) -> set[str]:
    tree = ast.parse(open(path).read())
    is_package = path.endswith("__init__.py")
    found = set()

    def visit(node):
        if _is_main_block(node):
            return
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("ldt"):
                found.add(t)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    if layer is None:
        raise AssertionError(f"{module} has no layer in tests/test_layers.py LAYERS; add it")
    return layer


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_import_points_down(graph):
    upward = sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                    for m, targets in graph.items() for t in targets
                    if layer_of(t) > layer_of(m))
    assert not upward, "\n".join(upward)


def test_no_import_circles(graph):
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def connect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert not circles, circles


def test_the_checker_sees_an_upward_import(tmp_path):
    """The graph is read from the source: a function-local upward import is found."""
    path = tmp_path / "validate.py"
    path.write_text("def f():\n    from ldt.training.loop import train_worker\n"
                    "if __name__ == '__main__':\n    import ldt.job.train\n")
    found = _imports("ldt.topology.validate", str(path), {"ldt.topology.validate", "ldt.training.loop",
                                                 "ldt.job.train", "ldt.training"})
    assert found == {"ldt.training.loop"}
    assert layer_of("ldt.training.loop") > layer_of("ldt.topology.validate")


def test_every_package_is_installed():
    """A plain ``pip install .`` installs only the packages pyproject.toml lists."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {m for m, p in _modules().items() if p.endswith("__init__.py")}
    assert packages - listed == set(), "add these to [tool.setuptools] packages"
