"""The import graph obeys the layer diagram of docs/architecture.md ("Layers").

Every module of ``evictlab/`` is parsed (AST, nothing is imported), including imports inside
functions and under ``TYPE_CHECKING``. A package may import only from packages of a lower
layer (or from itself); packages of one layer do not import each other, so the package
graph has no cycle; and no module imports itself back through other modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "evictlab"
DOC = ROOT / "docs" / "architecture.md"


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """``{"evictlab.kv.attention": path, "evictlab.kv": path/__init__.py, ...}``."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every ``evictlab`` module name an import statement of ``path`` names, with its line:
    ``from A import b`` gives ``A.b`` (resolved to ``A`` when ``b`` is not a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                yield f"{name}.{alias.name}", node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, node.lineno


def resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module ``name`` refers to (its longest module prefix), or None outside evictlab."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in mods:
            return candidate
        parts.pop()
    return None


def import_graph(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """``{importer: {imported: line}}`` over evictlab's modules (self-imports dropped)."""
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        for name, line in imported_names(mod, path):
            if not name.startswith("evictlab"):
                continue
            target = resolve(name, mods)
            if target is not None and target != mod:
                graph[mod].setdefault(target, line)
    return graph


def package_of(module: str) -> str:
    """``evictlab.kv.attention`` -> ``kv``; ``evictlab.io`` -> ``io``; ``evictlab`` -> ``evictlab``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def doc_layers(text: str) -> dict[str, int]:
    """``{package: layer}`` from the first code block after the ``## Layers`` heading: lines
    ``N  pkg pkg ...`` (N the layer, 0 the lowest)."""
    section = text.split("\n## Layers", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Layers' section"
    block = re.search(r"```[^\n]*\n(.*?)```", section[1], re.S)
    assert block, "the Layers section has no code block"
    layers: dict[str, int] = {}
    for line in block.group(1).splitlines():
        m = re.match(r"^\s*(\d+)\s+(.*?)\s*$", line)
        if not m:
            continue
        for pkg in re.findall(r"[a-z_]+", m.group(2).split("#", 1)[0]):
            assert pkg not in layers, f"{pkg} is in two layers of the diagram"
            layers[pkg] = int(m.group(1))
    return layers


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


MODS = modules()
GRAPH = import_graph(MODS)
LAYERS = doc_layers(DOC.read_text(encoding="utf-8"))


def test_every_package_has_a_layer() -> None:
    pkgs = {package_of(m) for m in MODS} - {"evictlab"}
    assert sorted(pkgs - set(LAYERS)) == [], "add these packages to the Layers diagram of docs/architecture.md"
    assert sorted(set(LAYERS) - pkgs) == [], "the Layers diagram names packages that do not exist"


def test_the_root_package_imports_only_the_api() -> None:
    # evictlab/__init__.py holds the version and re-exports evictlab.api (lazily, on first use)
    assert set(GRAPH["evictlab"]) <= {"evictlab.api"}


def test_imports_run_down_the_layers() -> None:
    bad = []
    for mod, targets in GRAPH.items():
        a = package_of(mod)
        if a == "evictlab":  # the root's one import: test_the_root_package_imports_only_the_api
            continue
        for target, line in targets.items():
            b = package_of(target)
            if a == b or b == "evictlab":
                continue
            if LAYERS[b] >= LAYERS[a]:
                bad.append(f"{MODS[mod].relative_to(ROOT)}:{line}: {mod} (layer {LAYERS[a]}) imports {target} "
                           f"(layer {LAYERS[b]})")
    assert bad == [], "imports from a lower layer to a higher one or within a layer:\n" + "\n".join(bad)


def test_no_import_cycle_between_packages() -> None:
    pkg_graph: dict[str, set[str]] = {}
    for mod, targets in GRAPH.items():
        pkg_graph.setdefault(package_of(mod), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(mod))
    assert cycles(pkg_graph) == []


def test_no_import_cycle_between_modules() -> None:
    assert cycles({m: set(t) for m, t in GRAPH.items()}) == []


# --------------------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = tmp_path / "evictlab" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return modules(tmp_path / "evictlab")


def test_the_checker_sees_lazy_relative_and_from_imports(tmp_path: Path) -> None:
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from evictlab.high import b\n",  # lazy: counts
        "high/__init__.py": "",
        "high/b.py": "from ..low import a\nfrom evictlab.low.a import f\nimport evictlab.low\n",
    })
    graph = import_graph(mods)
    assert graph["evictlab.low.a"] == {"evictlab.high.b": 2}
    assert set(graph["evictlab.high.b"]) == {"evictlab.low.a", "evictlab.low"}
    pkg = {package_of(m): {package_of(t) for t in ts if package_of(t) != package_of(m)} for m, ts in graph.items()}
    assert cycles(pkg) == [["high", "low"]]
    assert cycles({m: set(t) for m, t in graph.items()}) == [["evictlab.high.b", "evictlab.low.a"]]


@pytest.mark.parametrize("text, layers", [
    ("## Layers\n\n```\n 2  top\n 1  mid  side   # comment\n 0  base\n```\n", {"top": 2, "mid": 1, "side": 1, "base": 0}),
])
def test_the_layer_diagram_is_read(text: str, layers: dict[str, int]) -> None:
    assert doc_layers("intro\n" + text) == layers
