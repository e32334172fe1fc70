"""Layers point down, and no module imports itself back (docs/architecture.md §2).

Every module under ``workbench/`` (the Triton kernels of ``workbench/kernels/`` included)
load) is parsed with :mod:`ast`; every ``import`` / ``from ... import``, at module level and inside
functions alike, is an edge of the import graph among these modules (``from pkg import name`` goes
to ``pkg.name`` when that is a module, else to ``pkg``). The implicit import of a module's parent
packages is not an edge: ``workbench/__init__.py`` is the public facade (it imports the engine),
and importing any ``workbench.x`` runs it.

Two checks: the graph has no cycle, and a module never imports one of a higher layer (:data:`LAYERS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("workbench",)

#: layer -> the top-level parts of ``workbench`` (a module or subpackage) it holds; ``kernels`` holds the
#: Triton kernels, ``__init__`` the ``workbench`` facade. Lower numbers are lower layers;
#: a module may import its own layer and below.
LAYERS: dict[int, tuple[str, ...]] = {
    # plain data and the KV managers: the engine arguments, requests, sampling parameters, the
    # model/GPU catalogue (imports nothing of ours; config asks it which names are the bundled model)
    0: (
        "config",
        "cpu_dtype",
        "omp_wait",
        "request",
        "sampling_params",
        "kv",
        "units",
        "comm",
        "inputs",
        "outputs",
        "plugins",
        "catalog",
    ),
    # what the model and the engine core build on: attention backends and kernels, communication
    # counters, step statistics, the scheduler (over kv/), the sampler and its operations (penalties,
    # logprobs), the output processor (incremental text, stop strings), the KV managers' conformance
    # check (the scheduler over random schedules)
    1: ("attention", "kernels", "metrics", "scheduler", "sampling", "sample_ops", "output_processor", "conformance"),
    # the model (uses attention, comm, catalog) and the memory budget (uses attention)
    2: ("model", "memory"),
    # the KV calculator (a model's architecture, its memory budget)
    3: ("kvcalc",),
    # the model runner: local and tensor-parallel executors
    4: ("executor",),
    # the engine: scheduler + KV manager + executor + metrics
    5: ("engine",),
    # everything built on the engine, and the facade
    6: ("server", "sim", "bench", "viz", "labs", "cli", "entrypoints", "__init__"),
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
    key = parts[1] if len(parts) > 1 else "__init__"
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
    assert "workbench.kernels" in GRAPH["workbench.attention.backend"]


def test_every_module_has_a_layer():
    for module in GRAPH:
        layer_of(module)


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (each: modules that import one another, directly or not):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in cycles
    )


def test_layers_point_down():
    bad = [
        f"  {m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, ts in sorted(GRAPH.items())
        for t in sorted(ts)
        if layer_of(t) > layer_of(m)
    ]
    assert not bad, "a lower layer imports a higher one (see LAYERS):\n" + "\n".join(bad)


def test_a_cycle_and_an_upward_import_are_caught():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("workbench.model.llama") > layer_of("workbench.config")
    assert layer_of("workbench.labs.ch09_tensor_parallelism") > layer_of("workbench.engine")


def test_no_top_level_package_but_workbench():
    """The wheel ships ``workbench`` only: a top-level ``kernels/`` of ours shadowed Hugging Face's ``kernels``
    distribution, which transformers (>= 5.25) requires and imports, and broke ``import transformers``."""
    import tomllib

    ours = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    assert ours == ["workbench"], f"top-level packages besides workbench: {ours}"
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["workbench*"]
