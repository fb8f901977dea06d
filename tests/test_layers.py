"""The house's layering, read from the source: imports run downward only (jobs -> cluster ->
engine), engine/ never imports ray or pyarrow, and no module imports itself back through
others (no import circles). The map is built from every `import` statement in the three
packages, inside functions too: a lazy import is still a dependency a reader must follow.

`importlib.import_module("a.b")` with a literal name counts as an import too, except the
deprecated aliases kept for one release (a module-level `__getattr__` that forwards an old
name upward and warns), each listed in `ALIASES` so that none is added without a test
saying so."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "cluster", "jobs")
LAYER = {"engine": 0, "cluster": 1, "jobs": 2}
# (module, the module it forwards an old name to): deprecated aliases, for one release
ALIASES: set[tuple[str, str]] = {("cluster", "jobs.pool")}  # `from cluster import GenerationPool`


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def import_map() -> dict[str, set[str]]:
    """module -> the modules it imports, the project's and others (a `from a.b import c`
    counts as a.b.c when that is a project module, else a.b)."""
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against the package
                    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [] if (name, node.args[0].value) in ALIASES else [node.args[0].value]
            else:
                continue
            out.update(targets)
        edges[name] = out
    return edges


def _project(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    mods = set(edges)
    return {k: {t for t in v if t in mods and t != k} for k, v in edges.items()}


def test_no_import_runs_upward():
    """engine imports neither cluster nor jobs; cluster does not import jobs."""
    bad = [f"{src} imports {dst}" for src, dsts in _project(import_map()).items() for dst in sorted(dsts)
           if LAYER[dst.split(".")[0]] > LAYER[src.split(".")[0]]]
    assert not bad, "imports that run upward:\n" + "\n".join(bad)


def test_engine_never_imports_ray_or_pyarrow():
    bad = [f"{src} imports {t}" for src, ts in import_map().items() if src.split(".")[0] == "engine"
           for t in sorted(ts) if t.split(".")[0] in ("ray", "pyarrow")]
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    """Tarjan's strongly connected components over the project's import map: every one is a
    single module."""
    edges = _project(import_map())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_map_sees_real_imports():
    """The map is not empty by accident: the engine's step loop imports the scheduler and
    the job runner imports the cluster's dispatcher module."""
    edges = _project(import_map())
    assert any(t.startswith("engine.") for t in edges["engine.engine"])
    assert any(t.startswith("cluster.") for src, ts in edges.items() if src.startswith("jobs.") for t in ts)


def test_deprecated_aliases_warn_and_forward():
    """The aliases of ALIASES work for their one release: `from cluster import GenerationPool`
    warns (DeprecationWarning, naming the new import) and gives jobs.pool's class itself."""
    from jobs import GenerationPool

    with pytest.warns(DeprecationWarning, match="from jobs import GenerationPool"):
        from cluster import GenerationPool as old
    assert old is GenerationPool
    import jobs.pool

    assert GenerationPool is jobs.pool.GenerationPool
