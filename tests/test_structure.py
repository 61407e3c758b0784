"""The shape of src/batchlab, read statically (ast): no import cycle between modules, function-level and
TYPE_CHECKING imports included, and no module over 400 lines.  The detector is tested on tiny packages."""
from __future__ import annotations

import ast
from pathlib import Path


SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 400


def modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``src/package`` (a package is its __init__)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _targets(node: ast.AST, pkg: str) -> list[str]:
    """Dotted names an import statement may load, relative imports made absolute against ``pkg``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports anywhere in its body.  Importing an ancestor package
    is not an edge (Python has run the ancestors' __init__ before the module itself)."""
    mods = modules(src, package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, pkg):
                while target and target not in mods:  # package.module.name -> package.module
                    target = target.rpartition(".")[0]
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_detector_finds_function_level_and_relative_cycles(tmp_path):
    write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "import pkg.b\n\ndef f():\n    return pkg.b.g()\n",
        "pkg/b.py": "def g():\n    from pkg.a import f  # function-level: still a cycle\n    return f\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from . import d\n",
        "pkg/sub/d.py": "def h():\n    from .c import d\n",
        "pkg/sub/e.py": "from pkg import a  # an ancestor's __init__ plus a module: one edge, to a\n",
        "pkg/leaf.py": "from pkg.sub.e import a\nimport os\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.e"] == {"pkg.a"} and graph["pkg.leaf"] == {"pkg.sub.e"}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_detector_finds_a_long_cycle_through_a_package_init(tmp_path):
    write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/x/__init__.py": "from pkg.x.run import go\n",
        "pkg/x/run.py": "from pkg.y import helper\n",
        "pkg/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.x import go\n",
    })
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.x", "pkg.x.run", "pkg.y"]]


def test_an_acyclic_package_has_no_cycle(tmp_path):
    write(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n", "pkg/a.py": "from pkg.b import y\n",
                     "pkg/b.py": "import json\n"})
    assert cycles(import_graph(tmp_path, "pkg")) == []


def test_no_import_cycle_between_modules():
    found = cycles(import_graph(SRC, "batchlab"))
    assert found == [], "import cycles: " + " | ".join(" <-> ".join(c) for c in found)


def test_no_module_over_400_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules(SRC, "batchlab").items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}
