"""The package's structure (issue 18): imports run one way, and one module orders the passes.

Reads ``tvm_fusion``'s source with ``ast`` (nothing is imported), every import at module level
and inside functions alike, and checks:

* no import cycle between ``tvm_fusion`` modules (the cycle is printed);
* no module imports another module's private (``_name``) name, by ``from m import _x`` or by
  ``m._x`` on an imported module;
* the pass packages (``relay_passes``, ``layout``, ``tir_schedules``) import nothing from the
  layers above them (tuning, transform, pipeline, compile, the applications): what they need
  from above (the profitability oracle, Apollo's blocklist) is handed to them as objects;
* pass lists are assembled (``tvm.transform.Sequential(...)``) only in ``tvm_fusion/pipeline.py``.

A module's parent packages run their ``__init__`` when it is imported; those implicit edges are
Python's, not the module's, and are not counted (every module is under ``tvm_fusion`` and
``tvm_fusion/__init__.py`` imports the API it re-exports).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "tvm_fusion"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

PASS_PACKAGES = ("relay_passes", "layout", "tir_schedules")
ABOVE_PASSES = ("tuning", "transform", "pipeline", "compile", "cli", "report", "bench")
# Modules inside the pass packages that belong to a layer above: they build whole models, so
# they may import the build. Nothing in the pass packages imports them.
DRIVERS_IN_PASS_PACKAGES = {
    "tvm_fusion.layout.measure": "SmartMem's measurement: builds models with and without it",
    "tvm_fusion.relay_passes.rewrite.measure": "the rewriting's measurement: builds models",
    "tvm_fusion.layout.pipeline": "SmartMem's and Adreno's build entry points (tutorial 04)",
}
# tvm.transform.Sequential outside pipeline.py, each with the reason it is no pass list of a build
SEQUENTIAL_ALLOWED = {
    "tvm_fusion.relay_passes.rewrite.math_properties":
        "the pass's own clean-up (CanonicalizeBindings, DCE) after rewriting, part of one pass",
    "tvm_fusion.layout.conv_pack":
        "packing is one all-or-nothing step: a failure keeps NCHW, so its TVM passes run as a unit",
    "tvm_fusion.tir_schedules.optifx":
        "lowers one scheduled PrimFunc's blocks to read its compacted buffers (an analysis)",
    "tvm_fusion.layout.texture_lower":
        "the TIR lowering of texture kernels, registered for tvm.tirx.build by name",
}
SEQUENTIALS = ("tvm.transform.Sequential", "tvm.ir.transform.Sequential")

# The layers, top down (docs/architecture.md); a module is in the layer of its longest prefix
# here (the package's __init__, ``tvm_fusion``, the API facade, is only itself), and imports
# only from its own layer and those below.
LAYERS = {
    "apps": ("tvm_fusion", "tvm_fusion.cli", "tvm_fusion.report", "tvm_fusion.bench",
             "tvm_fusion.visualize", "tvm_fusion.zoo", "tvm_fusion.export_models",
             "tvm_fusion.export_architectures",
             "tvm_fusion.fuzz", "tvm_fusion.testing", "tvm_fusion.tuning.tune_cli",
             "tvm_fusion.tuning.db_cli"),
    "driver": ("tvm_fusion.compile", "tvm_fusion.memory", "tvm_fusion.build_cache",
               "tvm_fusion.tuning.tune",
               *DRIVERS_IN_PASS_PACKAGES),
    "transform": ("tvm_fusion.transform",),
    "profiling": ("tvm_fusion.tuning",),  # what transform hands the planners
    "pipeline": ("tvm_fusion.pipeline",),
    "passes": tuple(f"{PACKAGE}.{p}" for p in PASS_PACKAGES),
    "frontend": ("tvm_fusion.frontend",),  # TVM's importers plus repairs
    "helpers": ("tvm_fusion.options", "tvm_fusion.instrument", "tvm_fusion.tir_utils",
                "tvm_fusion.symbolic", "tvm_fusion.target", "tvm_fusion.devices",
                "tvm_fusion.native_log", "tvm_fusion.atomic", "tvm_fusion.threads",
                "tvm_fusion.feeds", "tvm_fusion.numerics", "tvm_fusion.models",
                "tvm_fusion.onnx_names", "tvm_fusion.graph_layout",
                "tvm_fusion.module_update"),
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the tvm_fusion module imported (a package means its __init__)
    line: int
    private: tuple[str, ...] = ()  # private names taken from target


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[Import]:
    """Every import of a tvm_fusion module by ``module``, at any depth of its source."""
    found, aliases = [], {}  # aliases: local name -> tvm_fusion module it is bound to
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    found.append(Import(module, alias.name, node.lineno))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            if base.split(".")[0] != PACKAGE:
                continue
            plain = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:  # ``from package import module``
                    found.append(Import(module, sub, node.lineno))
                    aliases[alias.asname or alias.name] = sub
                else:
                    plain.append(alias.name)
            if plain:
                private = tuple(n for n in plain if _is_private(n))
                found.append(Import(module, base, node.lineno, private))
    for node in ast.walk(TREES[module]):  # ``module._name`` on an imported module
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _is_private(node.attr)):
            found.append(Import(module, aliases[node.value.id], node.lineno, (node.attr,)))
    return [i for i in found if i.target != module]


IMPORTS = [i for m in MODULES for i in _imports(m)]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        graph[imp.source].add(imp.target)
    return graph


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: each holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [sorted(c) for c in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    start = min(component)
    path, seen = [start], {start}
    while True:  # walk inside the component until a module repeats
        nxt = min(w for w in graph[path[-1]] if w in component)
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)


def _where(source: str, target: str) -> str:
    lines = sorted({i.line for i in IMPORTS if i.source == source and i.target == target})
    return f"{source} -> {target} (line {', '.join(map(str, lines))})"


def test_the_walk_sees_the_package():
    assert len(MODULES) > 50 and "tvm_fusion.pipeline" in MODULES
    assert any(i.source == "tvm_fusion.transform" and i.target == "tvm_fusion.pipeline"
               for i in IMPORTS)


def test_no_import_cycles():
    graph = _graph()
    text = []
    for component in _components(graph):
        cycle = _cycle_in(set(component), graph)
        text.append(f"{len(component)} modules import each other: {', '.join(component)}\n"
                    f"  for one: {' -> '.join(cycle)}\n    "
                    + "\n    ".join(_where(a, b) for a, b in zip(cycle, cycle[1:])))
    assert not text, f"import cycles in {PACKAGE}:\n" + "\n".join(text)


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}
    assert _components(graph) == [["a", "b", "c"]]
    assert _cycle_in({"a", "b", "c"}, graph) == ["a", "b", "c", "a"]


def test_no_private_names_across_modules():
    bad = [f"{i.source} (line {i.line}) takes {', '.join(i.private)} from {i.target}"
           for i in IMPORTS if i.private]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _in(module: str, packages) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[0] == PACKAGE and parts[1] in packages


def test_nothing_in_the_pass_packages_imports_their_drivers():
    bad = [_where(i.source, i.target) for i in IMPORTS if i.target in DRIVERS_IN_PASS_PACKAGES
           and _in(i.source, PASS_PACKAGES) and i.source not in DRIVERS_IN_PASS_PACKAGES]
    assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("package", PASS_PACKAGES)
def test_passes_do_not_import_the_layers_above(package):
    bad = [_where(i.source, i.target) for i in IMPORTS
           if _in(i.source, (package,)) and i.source not in DRIVERS_IN_PASS_PACKAGES
           and _in(i.target, ABOVE_PASSES)]
    assert not bad, f"{package} imports from the layers above it:\n" + "\n".join(sorted(set(bad)))


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _sequential_calls(module: str) -> list[int]:
    """Lines of ``tvm.transform.Sequential(...)`` calls, however ``tvm`` names were imported."""
    names = {}  # local name -> what it stands for
    tree = TREES[module]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            dotted = _dotted(node.func)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            full = names.get(head, head) + (f".{rest}" if rest else "")
            if full in SEQUENTIALS:
                lines.append(node.lineno)
    return lines


def test_pass_lists_are_assembled_only_in_pipeline_py():
    found = {m: _sequential_calls(m) for m in MODULES}
    bad = [f"{m} (line {', '.join(map(str, lines))})" for m, lines in sorted(found.items())
           if lines and m != "tvm_fusion.pipeline" and m not in SEQUENTIAL_ALLOWED]
    assert not bad, "pass lists assembled outside tvm_fusion/pipeline.py:\n" + "\n".join(bad)
    assert found["tvm_fusion.pipeline"], "pipeline.py assembles the pass lists"
    stale = [m for m in SEQUENTIAL_ALLOWED if not found.get(m)]
    assert not stale, f"allowed but no longer needed: {stale}"


def test_the_sequential_check_sees_every_spelling():
    source = ("import tvm\nfrom tvm import transform\nfrom tvm.transform import Sequential as S\n"
              "tvm.transform.Sequential([])\ntransform.Sequential([])\nS([])\n"
              "tvm.ir.transform.Sequential([])\nfrom .transform import Sequential\nSequential()\n")
    TREES["<example>"] = ast.parse(source)
    try:
        assert _sequential_calls("<example>") == [4, 5, 6, 7]
    finally:
        del TREES["<example>"]


def _layer(module: str) -> int:
    """The rank of ``module``'s layer (0: the top), by the longest prefix in :data:`LAYERS`."""
    best, rank = "", None
    for i, prefixes in enumerate(LAYERS.values()):
        for prefix in prefixes:
            inside = prefix != PACKAGE and module.startswith(prefix + ".")  # the root: itself
            if (module == prefix or inside) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank is not None, f"{module} is in no layer of LAYERS"
    return rank


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_run_down_the_layers():
    names = list(LAYERS)
    bad = [f"{_where(i.source, i.target)}: {names[_layer(i.source)]} imports "
           f"{names[_layer(i.target)]}" for i in IMPORTS if _layer(i.target) < _layer(i.source)]
    assert not bad, "imports that run up the layers:\n" + "\n".join(sorted(set(bad)))
