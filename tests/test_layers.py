"""The house: ldt's packages import down the data flow of a step, never up, never in a circle.

Every package of the installed ``ldt`` (``ldt.patches`` from ``patches/``, ``ldt.tools`` from
``tools/``) sits on one layer of :data:`LAYERS`; an import, at module level or inside a
function, may only point to the same layer or a lower one, two packages never import each
other, and a file's header says what it depends on (ldt imports inside functions only at the
named entry points). An ``if __name__ == "__main__":`` block is a command's entry, not a
dependency, and is not counted. A package added without a layer fails here: give it one.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = (("ldt", "ldt"), ("patches", "ldt.patches"), ("tools", "ldt.tools"))

# low -> high: the steps of a training step's data flow, each package on exactly one layer
LAYERS = [
    ["ldt", "ldt.config"],           # 0 the typed config, its loading, the layout grammar
    ["ldt.storage", "ldt.launch"],   # 1 files on disk; processes and what they print
    ["ldt.patches"],                 # 2 adapters into megatron-core (megatron-core and config only)
    ["ldt.schedule", "ldt.models"],  # 3 schedules as data; the model's shapes and stage chunks
    ["ldt.data"],                    # 4 the data stages' input
    ["ldt.topology"],                # 5 who is where, every group and route, checks before comm
    ["ldt.plan", "ldt.groups"],      # 6 the planner (pure); the process groups of a rank plan
    ["ldt.boundary", "ldt.p2p"],     # 7 a tensor crossing a stage boundary
    ["ldt.pipeline"],                # 8 the runtime that walks a schedule's actions
    ["ldt.training"],                # 9 one rank's training job
    ["ldt.memory", "ldt.elastic"],   # 10 the memory estimate; an elastic world's plan
    ["ldt.job"],                     # 11 Hydra, the jobs of ldt-train, a Megatron script
    ["ldt.privacy"],                 # 12 the privacy audit (runs jobs)
    ["ldt.tools", "ldt.testing"],    # 13 the command lines; test infrastructure
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


# Named entry points: a command's module may import what loads torch, megatron-core or Hydra
# inside its functions, so that `--help` and a refusal answer before those load.
ENTRY_POINTS = ("ldt.tools", "ldt.job")
MAX_IN_FUNCTION_SHARE = 0.15


def _ldt_imports_by_place(path: str) -> tuple[list, list]:
    """(module-level, in-function) ldt imports of one file, as line numbers."""
    header, inside = [], []

    def visit(node, in_function):
        if _is_main_block(node):
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = ([child.module or ""] if isinstance(child, ast.ImportFrom)
                         else [a.name for a in child.names])
                if any(n == "ldt" or n.startswith("ldt.") for n in names):
                    (inside if in_function else header).append(child.lineno)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(open(path).read()), False)
    return header, inside


def test_every_package_sits_on_one_layer():
    """A layer lists whole packages (``ldt.X``), each once: a package is one step of the data
    flow, not split between steps."""
    listed = [p for layer in LAYERS for p in layer]
    assert len(listed) == len(set(listed))
    assert all(p == "ldt" or p.count(".") == 1 for p in listed), listed
    tops = {".".join(m.split(".")[:2]) for m in _modules()}
    assert tops <= set(listed), f"packages without a layer: {sorted(tops - set(listed))}"


def test_no_loop_between_packages(graph):
    """Packages on one layer may import each other, but not both ways round."""
    pkg = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    edges = {(pkg(a), pkg(b)) for a, bs in graph.items() for b in bs if pkg(a) != pkg(b)}
    both = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not both, both


def test_imports_sit_in_the_header():
    """A file's header says what it depends on: ldt's own modules are imported at module
    level, except by the named entry points (which keep torch, megatron-core and Hydra out of
    `--help`); and those exceptions stay a small share of all of ldt's imports."""
    header = inside = 0
    stray = []
    for module, path in _modules().items():
        top, nested = _ldt_imports_by_place(path)
        header, inside = header + len(top), inside + len(nested)
        if nested and not module.startswith(ENTRY_POINTS):
            stray += [f"{os.path.relpath(path, ROOT)}:{line}" for line in nested]
    assert not stray, "move these imports to the module's header:\n" + "\n".join(stray)
    share = inside / (header + inside)
    assert share <= MAX_IN_FUNCTION_SHARE, f"{share:.1%} of ldt's imports sit inside functions"


def test_the_header_check_sees_an_import_in_a_function(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from ldt.config import ConfigError\n\ndef f():\n    import ldt.plan\n"
                    "    from os import path\n")
    assert _ldt_imports_by_place(str(path)) == ([1], [4])
