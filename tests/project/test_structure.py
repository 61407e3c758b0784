"""The shape of src/batchlab, read statically (ast): the packages in layers (each imports only its own modules
and packages of lower layers), no import cycle between modules, function-level and TYPE_CHECKING imports
included, and no module over 400 lines.  The detector is tested on tiny packages."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest


SRC = Path(__file__).resolve().parents[2] / "src"
MAX_LINES = 400
# The package layers, bottom first: a package may import its own modules and any package of a lower layer, never
# one of its own layer or above.  docs/architecture.md draws the same list (a test below compares them).
LAYERS = [
    ["util"],
    ["host"],
    ["config"],
    ["formula", "timeline"],
    ["models", "cache"],
    ["measure"],
    ["distributed"],
    ["run", "trace"],
    ["calibrate"],
    ["experiment", "advise"],
    ["report"],
    ["integrations"],
    ["cli"],
    ["__init__", "__main__"],  # batchlab itself (``batchlab.observe``) and ``python -m batchlab``
]


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


def package_of(module: str) -> str:
    """``batchlab.measure.session`` -> ``measure``; the package's own __init__ and __main__ by those names."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Each import of a package of the same or a higher layer ("a -> b" per module edge); a package that is in
    no layer is one too."""
    rank = {p: i for i, layer in enumerate(layers) for p in layer}
    out = []
    for mod, targets in sorted(graph.items()):
        a = package_of(mod)
        if a not in rank:
            out.append(f"{mod}: package {a} is in no layer")
            continue
        out += [f"{mod} -> {t}" for t in sorted(targets)
                if package_of(t) != a and rank.get(package_of(t), len(layers)) >= rank[a]]
    return out


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


def test_layer_check_finds_upward_same_layer_and_unlisted_imports(tmp_path):
    write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "", "pkg/low/a.py": "def f():\n    from pkg.high.b import g  # upward, function-level\n",
        "pkg/high/__init__.py": "", "pkg/high/b.py": "from pkg.low import a\nfrom pkg.side import c\n",
        "pkg/side/__init__.py": "", "pkg/side/c.py": "",
        "pkg/stray/__init__.py": "",
    })
    found = layer_violations(import_graph(tmp_path, "pkg"), [["low"], ["high", "side"], ["__init__"]])
    assert found == ["pkg.high.b -> pkg.side", "pkg.high.b -> pkg.side.c", "pkg.low.a -> pkg.high.b",
                     "pkg.stray: package stray is in no layer"]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """batchlab's own import graph, parsed once for the module's three tests that read it (a parse reads every
    module's ast, the same work for each); read, never changed."""
    return import_graph(SRC, "batchlab")


def test_every_import_goes_to_a_lower_layer(graph):
    found = layer_violations(graph, LAYERS)
    assert found == [], "imports against the layers: " + " | ".join(found)


def test_no_import_cycle_between_modules(graph):
    found = cycles(graph)
    assert found == [], "import cycles: " + " | ".join(" <-> ".join(c) for c in found)


def test_no_module_over_400_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules(SRC, "batchlab").items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


ARCHITECTURE = SRC.parent / "docs" / "architecture.md"


def _block(heading: str) -> list[str]:
    """The lines of the first code block under ``heading`` in docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    text = text[text.index(heading):]
    start = text.index("```\n") + 4
    return text[start:text.index("```", start)].splitlines()


def test_the_architecture_page_draws_the_enforced_layers_in_order():
    drawn: dict[int, list[str]] = {}
    for line in _block("## Packages in layers"):
        number, package = line.split()[:2]
        drawn.setdefault(int(number), []).append(package)
    assert [drawn[n] for n in sorted(drawn)] == LAYERS, "docs/architecture.md's layers differ from LAYERS"
    assert sorted(drawn) == list(range(1, len(LAYERS) + 1))


def test_the_architecture_page_lists_every_module():
    listed, package = set(), ""
    for line in _block("## Modules")[1:]:
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        if indent == 2 and name.endswith("/"):
            package = name.rstrip("/")
        else:
            listed.add(f"{package}/{name}" if indent == 4 else name)
    src = SRC / "batchlab"
    actual = {str(p.relative_to(src)) for p in src.rglob("*.py")
              if p.name != "__init__.py" or p.parent == src or len(list(p.parent.glob("*.py"))) == 1}
    assert sorted(actual - listed) == [] and sorted(listed - actual) == []


def test_the_architecture_page_draws_the_imports_between_packages(graph):
    drawn = {}
    for line in _block("## Imports between packages"):
        package, _, targets = line.partition("->")
        drawn[package.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    actual: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for mod, targets in graph.items():
        actual[package_of(mod)] |= {package_of(t) for t in targets} - {package_of(mod)}
    assert drawn == actual


def test_a_dtensors_local_shard_is_read_in_one_place():
    """DTensor's private ``_local_tensor`` is spelled in measure/shards.py alone (its local_shard): a torch that
    renames it breaks one helper, not every module that counts or reduces a rank's own part."""
    spelled = sorted(str(p.relative_to(SRC)) for p in (SRC / "batchlab").rglob("*.py")
                     if '"_local_tensor"' in p.read_text())
    assert spelled == ["batchlab/measure/shards.py"]


def test_fsdp2_wraps_its_units_in_one_place():
    """The measured engines (ZeRO-2/3) and the TP / PP layouts' data dimension shard with one function
    (distributed/engines.py fsdp_units): one place for the units, the resharding and the mixed-precision policy."""
    import re

    calls = [(str(p.relative_to(SRC)), n) for p in (SRC / "batchlab").rglob("*.py")
             if (n := len(re.findall(r"^\s*fully_shard\(", p.read_text(), re.M)))]  # statements, not printed text
    assert calls == [("batchlab/distributed/engines.py", 1)]
