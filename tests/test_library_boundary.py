"""Scripts import the library, never the reverse: no module of the installed package reaches into the source
checkout (scripts/ or the lab's research/ by path, REPO_ROOT, a path climbing out of the package from __file__)."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the side folders install as fate_edge.*; the lab as fate_edge_lab
PACKAGE_DIRS = ["fate_edge", "predictors", "quant", "devices", "fate_edge_lab"]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _from_file(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node))


def checkout_references(source: str) -> list[str]:
    """What in ``source`` ties a module to the source checkout, one line each ("line N: why")."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        why = None
        if isinstance(node, ast.Name) and node.id == "REPO_ROOT":
            why = "REPO_ROOT"
        elif isinstance(node, ast.Attribute) and node.attr == "spec_from_file_location":
            why = "a module loaded by file path"
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and (
                node.value.strip("/") in ("scripts", "research")
                or "scripts/" in node.value
                or "research/" in node.value
            )
        ):
            why = f"the path {node.value!r}"
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "parents"
            and _from_file(node.value)
        ):
            why = "a folder above the package (Path(__file__).parents[...])"
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "parent"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "parent"
            and _from_file(node.value)
        ):
            why = "a folder above the package (Path(__file__).parent.parent)"
        if why:
            found.append(f"line {node.lineno}: {why}")
    return found


def test_the_check_catches_what_the_bench_and_calibrate_used_to_do():
    old = (
        "REPO_ROOT = Path(__file__).resolve().parents[1]\n"
        'path = REPO_ROOT / "scripts" / "make_inflated_model.py"\n'
        'spec = importlib.util.spec_from_file_location("m", path)\n'
        '_TRAIN = Path(__file__).parent.parent / "scripts/train_tiny_moe.py"\n'
    )
    found = checkout_references(old)
    assert len(found) == 7, found  # REPO_ROOT twice, parents[1], "scripts", the loader, parent.parent, the path
    assert checkout_references('"""Docstrings may name scripts/test.sh."""\nx = Path(__file__).parent / "a"\n') == []
    assert sorted(
        checkout_references('p = ROOT / "research" / "bench_io.py"\nq = "research/probe_text_spread.py"\n')
    ) == [
        "line 1: the path 'research'",
        "line 2: the path 'research/probe_text_spread.py'",
    ]


@pytest.mark.parametrize("folder", PACKAGE_DIRS)
def test_no_library_module_refers_to_the_checkout(folder):
    modules = sorted((REPO / folder).rglob("*.py"))
    assert modules
    bad = {str(p.relative_to(REPO)): refs for p in modules if (refs := checkout_references(p.read_text()))}
    assert bad == {}, f"library modules tied to the source checkout (scripts import the library, not back): {bad}"


# ----------------------------------------------------------------------------------------- import direction
# The concern packages, bottom to top: a module imports only from its own layer or the layers below it (function-level
# and type-checking imports included). predictors/, quant/ and devices/ are leaf packages of the product card.
LAYERS = [
    "fate_edge.errors fate_edge.sizes fate_edge.version fate_edge.app_dirs fate_edge.process_memory fate_edge.corpus "
    "fate_edge.bundled fate_edge.tokenizer fate_edge.native_build fate_edge.huge_pages fate_edge.small_files",
    "fate_edge.quant fate_edge.devices",
    "fate_edge.defaults",
    "fate_edge.model",
    "fate_edge.predictors",
    "fate_edge.format",
    "fate_edge.fetch",
    "fate_edge.runtime",
    "fate_edge.planning",
    "fate_edge.apps fate_edge.sdk fate_edge.__main__",
    "fate_edge",  # the package itself: its public names come from every layer
    "fate_edge_lab",  # the lab (benchmarks, synthetic checkpoints, bounds) imports the product, never the reverse
]
PACKAGE_ROOTS = {
    "fate_edge": REPO / "fate_edge",
    "fate_edge.predictors": REPO / "predictors",
    "fate_edge.quant": REPO / "quant",
    "fate_edge.devices": REPO / "devices",
    "fate_edge_lab": REPO / "fate_edge_lab",
}


def module_files(roots: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every module under the roots."""
    out = {}
    for pkg, folder in roots.items():
        for p in folder.rglob("*.py"):
            parts = list(p.relative_to(folder).with_suffix("").parts)
            if pkg == "fate_edge" and parts[0] in ("predictors", "quant", "devices"):
                continue
            is_init = parts[-1] == "__init__"
            out[".".join([pkg] + parts[: -1 if is_init else None])] = (p, is_init)
    return out


def import_edges(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its text (``from pkg import submodule`` names the
    submodule; ``from module import name`` the module)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, (path, is_init) in modules.items():
        base = name if is_init else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {known(a.name) for a in node.names if a.name.startswith("fate_edge")}
            elif isinstance(node, ast.ImportFrom):
                origin = base
                for _ in range(max(node.level - 1, 0)):
                    origin = origin.rpartition(".")[0]
                full = (origin + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                if full.startswith("fate_edge"):
                    found |= {
                        known(f"{full}.{a.name}") if f"{full}.{a.name}" in modules else known(full) for a in node.names
                    }
        edges[name] = found - {None, name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    best = (-1, -1)
    for rank, names in enumerate(LAYERS):
        for prefix in names.split():
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), rank)
    assert best[1] >= 0, f"{module} is in no layer of LAYERS: add it"
    return best[1]


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs if layer_of(b) > layer_of(a))


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "fate_edge"
    (pkg / "model").mkdir(parents=True)
    (pkg / "runtime").mkdir()
    for init in (pkg / "__init__.py", pkg / "model" / "__init__.py", pkg / "runtime" / "__init__.py"):
        init.write_text("")
    (pkg / "model" / "rope.py").write_text("def f():\n    from fate_edge.runtime.engine import Engine\n")
    (pkg / "runtime" / "engine.py").write_text("from ..model import rope\n")
    edges = import_edges(module_files({"fate_edge": pkg}))
    assert edges["fate_edge.runtime.engine"] == {"fate_edge.model.rope"}
    assert cycles(edges) == [["fate_edge.model.rope", "fate_edge.runtime.engine"]]
    assert upward(edges) == ["fate_edge.model.rope -> fate_edge.runtime.engine"]


def test_no_import_cycles_in_the_package():
    assert cycles(import_edges(module_files(PACKAGE_ROOTS))) == []


def test_each_layer_imports_only_the_layers_below_it():
    assert upward(import_edges(module_files(PACKAGE_ROOTS))) == []


def test_few_modules_sit_directly_in_the_package():
    flat = sorted(p.name for p in (REPO / "fate_edge").glob("*.py"))
    assert len(flat) <= 15, f"{len(flat)} modules directly in fate_edge/ (put each in its concern package): {flat}"


@pytest.mark.parametrize("folder", PACKAGE_DIRS)
def test_no_issue_numbers_in_library_code(folder):
    """Docstrings and comments say what the code does; history and results live in docs/."""
    pattern = re.compile(r"\bissue\s*#?\d+", re.IGNORECASE)
    bad = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sorted((REPO / folder).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert bad == []


@pytest.mark.parametrize("folder", ["fate_edge", "predictors", "quant", "devices"])
def test_command_lines_live_under_apps(folder):
    """The library takes arguments as Python values; parsing a command line is the entry points' job (apps/) and the
    lab's."""
    apps = REPO / "fate_edge" / "apps"
    bad = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / folder).rglob("*.py"))
        if apps not in p.parents and re.search(r"^\s*(import argparse|from argparse import)", p.read_text(), re.M)
    ]
    assert bad == []


@pytest.mark.parametrize("folder", PACKAGE_DIRS)
def test_no_module_over_600_lines(folder):
    """One job per module: a module past 600 lines is split by job (planning/planner.py was 639)."""
    long = {
        str(p.relative_to(REPO)): n
        for p in sorted((REPO / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}
