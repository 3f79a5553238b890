"""The package layout holds: imports point down the stages only, and no module imports itself back.

Every `import`/`from ... import` of a kvsim module counts, at module level, inside functions (lazy) and
under `TYPE_CHECKING` alike: the walk reads the source, it does not run it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "kvsim"

# Stages in the order data flows; a module may import its own stage and those before it, never after.
STAGES = [
    ("kvsim.errors", "kvsim.units", "kvsim.vllm_version", "kvsim.out_paths"),
    ("kvsim.models",),
    ("kvsim.clock",),
    ("kvsim.size",),
    ("kvsim.engine",),
    ("kvsim.offload",),
    ("kvsim.workload",),
    ("kvsim.replay",),
    ("kvsim.plots",),
    ("kvsim.bench", "kvsim.profile", "kvsim.sweep", "kvsim.conformance", "kvsim.cache_curve"),
    ("kvsim.cli", "kvsim.__main__"),
]


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _resolve(dotted: str) -> str | None:
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imports(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("kvsim"):
            for alias in node.names:
                target = _resolve(f"{node.module}.{alias.name}") if f"{node.module}.{alias.name}" in MODULES else _resolve(node.module)
                found.add(target)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{name}: relative import; kvsim uses absolute imports")
        elif isinstance(node, ast.Import):
            found.update(_resolve(alias.name) for alias in node.names if alias.name.startswith("kvsim"))
    found.discard(None)
    found.discard(name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _stage(name: str) -> int | None:
    for rank, prefixes in enumerate(STAGES):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    return None


def test_every_module_has_a_stage():
    unplaced = [name for name in MODULES if name != "kvsim" and _stage(name) is None]
    assert not unplaced, f"modules outside every stage (add them to a package): {unplaced}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != "kvsim"))
def test_imports_point_down(name):
    upward = sorted(t for t in GRAPH[name] if t != "kvsim" and _stage(t) > _stage(name))
    assert not upward, f"{name} (stage {_stage(name)}) imports later stages: {upward}"


def test_no_import_cycles():
    # Tarjan's strongly connected components over the whole module graph
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
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
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_every_package_says_what_it_owns():
    for name, path in MODULES.items():
        if path.name == "__init__.py" and name != "kvsim":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "import" in doc.lower() and len(doc) > 80, f"{name}: __init__ docstring must say what it owns and may import"


def test_the_walk_sees_lazy_and_type_only_imports():
    # the replay imports the catalogue lazily inside run_replay: the walk must see it
    assert any(t.startswith("kvsim.models") for t in GRAPH["kvsim.replay.run"])
