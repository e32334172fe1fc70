"""Layers point down, and no module imports itself back (ARCHITECTURE §2).

Every module under ``workbench/`` (and the top-level ``kernels/`` package the attention backends
load) is parsed with :mod:`ast`; every ``import`` / ``from ... import``, at module level and inside
functions alike, is an edge of the import graph among these modules (``from pkg import name`` goes
to ``pkg.name`` when that is a module, else to ``pkg``). The implicit import of a module's parent
packages is not an edge: ``workbench/__init__.py`` is the public facade (it imports the engine),
and importing any ``workbench.x`` runs it.

Two checks: the graph has no cycle, and a module never imports one of a higher layer (:data:`LAYERS`).
Known violations in code being refactored elsewhere are listed with strict ``xfail``: once one is
fixed, its entry fails as XPASS and must be removed from the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("workbench", "kernels")

#: layer -> the top-level parts of ``workbench`` (a module or subpackage) it holds; ``kernels`` is the
#: top-level Triton package, ``__init__`` the ``workbench`` facade. Lower numbers are lower layers;
#: a module may import its own layer and below.
LAYERS: dict[int, tuple[str, ...]] = {
    # plain data and the KV managers: the engine arguments, requests, sampling parameters
    0: ("config", "request", "sampling", "kv", "units"),
    # what the model and the engine core build on: attention backends and kernels, communication
    # counters, the model/GPU catalogue, step statistics, the scheduler (over kv/)
    1: ("attention", "kernels", "comm", "catalog", "metrics", "scheduler"),
    # the model (uses attention, comm, catalog) and the memory budget (uses attention)
    2: ("model", "memory"),
    # the KV calculator (a model's architecture, its memory budget)
    3: ("kvcalc",),
    # the model runner: local and tensor-parallel executors
    4: ("executor",),
    # the engine: scheduler + KV manager + executor + metrics
    5: ("engine",),
    # everything built on the engine, and the facade
    6: ("server", "sim", "bench", "viz", "labs", "cli", "kvcalc_cli", "__init__"),
}

#: ``(importer, imported)`` edges that close a cycle today. Owned by the seams refactor, removed at merge.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {
    ("workbench.sim.cli", "workbench.cli"): "sim/cli.py imports cli.py, which imports sim/cli.py back",
    ("workbench.executor.tensor_parallel", "workbench"): (
        "the torchrun entry point (executor/tensor_parallel.py main) imports the facade, which imports the "
        "engine, which imports the executor"
    ),
}

#: ``(importer, imported)`` edges that point up a layer today. Owned by the seams refactor, removed at merge.
KNOWN_LAYER_VIOLATIONS: dict[tuple[str, str], str] = {
    (
        "workbench.config",
        "workbench.attention.backend",
    ): "config.validate checks attention_backend with attention.backend.check_backend",
    ("workbench.config", "workbench.comm"): "config.validate reads NCCL_MAX_CHANNELS and parse_nccl_proto from comm",
    ("workbench.config", "workbench.scheduler"): "config.validate reads BATCHING_POLICIES from scheduler",
    ("workbench.executor.tensor_parallel", "workbench"): "the torchrun entry point builds an LLM",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` refers to (itself, or the closest package above it that is ours)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(filter(None, (_owner(a.name, modules) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from ..y import z
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                target = full if full in modules else _owner(base, modules)
                if target:
                    out.add(target)
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the modules of ours it imports}``."""
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def layer_of(module: str) -> int:
    parts = module.split(".")
    key = parts[0] if parts[0] == "kernels" else (parts[1] if len(parts) > 1 else "__init__")
    for layer, names in LAYERS.items():
        if key in names:
            return layer
    raise KeyError(f"{module}: {key!r} has no layer; add it to LAYERS in {Path(__file__).name}")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


GRAPH = import_graph()


def test_the_graph_is_read():
    assert "workbench.engine" in GRAPH["workbench"]  # the facade
    assert "workbench.model.parallel" in GRAPH["workbench.model.llama"]
    assert "workbench.viz.figures" in GRAPH["workbench.viz.report"]
    assert "kernels" in GRAPH["workbench.attention.backend"]


def test_every_module_has_a_layer():
    for module in GRAPH:
        layer_of(module)


def test_no_import_cycles():
    graph = {m: {t for t in ts if (m, t) not in KNOWN_CYCLE_EDGES} for m, ts in GRAPH.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each: modules that import one another, directly or not):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in cycles
    )


def test_layers_point_down():
    bad = [
        f"  {m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, ts in sorted(GRAPH.items())
        for t in sorted(ts)
        if layer_of(t) > layer_of(m) and (m, t) not in KNOWN_LAYER_VIOLATIONS
    ]
    assert not bad, "a lower layer imports a higher one (see LAYERS):\n" + "\n".join(bad)


def test_a_cycle_and_an_upward_import_are_caught():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("workbench.model.llama") > layer_of("workbench.config")
    assert layer_of("workbench.labs.tensor_parallel") > layer_of("workbench.engine")


# owned by the seams refactor, removed at merge: each entry XPASSes (and so fails) once it is fixed
@pytest.mark.parametrize(
    "edge",
    [
        pytest.param(e, marks=pytest.mark.xfail(strict=True, reason=why), id="->".join(e))
        for e, why in KNOWN_CYCLE_EDGES.items()
    ],
)
def test_known_cycle_is_gone(edge):
    importer, imported = edge
    assert not any(importer in c and imported in c for c in _cycles(GRAPH))


# owned by the seams refactor, removed at merge: each entry XPASSes (and so fails) once it is fixed
@pytest.mark.parametrize(
    "edge",
    [
        pytest.param(e, marks=pytest.mark.xfail(strict=True, reason=why), id="->".join(e))
        for e, why in KNOWN_LAYER_VIOLATIONS.items()
    ],
)
def test_known_upward_import_is_gone(edge):
    importer, imported = edge
    assert imported not in GRAPH[importer] or layer_of(imported) <= layer_of(importer)
