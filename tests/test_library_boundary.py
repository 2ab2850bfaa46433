"""Scripts import the library, never the reverse: no module of the installed package reaches into the source
checkout (scripts/ by path, REPO_ROOT, a path climbing out of the package from __file__)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ["fate_edge", "predictors", "quant", "devices"]  # the side folders install as fate_edge.*


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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and (
                node.value.strip("/") == "scripts" or "scripts/" in node.value):
            why = f"the path {node.value!r}"
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parents" and _from_file(node.value):
            why = "a folder above the package (Path(__file__).parents[...])"
        elif isinstance(node, ast.Attribute) and node.attr == "parent" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parent" and _from_file(node.value):
            why = "a folder above the package (Path(__file__).parent.parent)"
        if why:
            found.append(f"line {node.lineno}: {why}")
    return found


def test_the_check_catches_what_the_bench_and_calibrate_used_to_do():
    old = ('REPO_ROOT = Path(__file__).resolve().parents[1]\n'
           'path = REPO_ROOT / "scripts" / "make_inflated_model.py"\n'
           'spec = importlib.util.spec_from_file_location("m", path)\n'
           '_TRAIN = Path(__file__).parent.parent / "scripts/train_tiny_moe.py"\n')
    found = checkout_references(old)
    assert len(found) == 7, found  # REPO_ROOT twice, parents[1], "scripts", the loader, parent.parent, the path
    assert checkout_references('"""Docstrings may name scripts/bench.py."""\nx = Path(__file__).parent / "a"\n') == []


@pytest.mark.parametrize("folder", PACKAGE_DIRS)
def test_no_library_module_refers_to_the_checkout(folder):
    modules = sorted((REPO / folder).rglob("*.py"))
    assert modules
    bad = {str(p.relative_to(REPO)): refs for p in modules if (refs := checkout_references(p.read_text()))}
    assert bad == {}, f"library modules tied to the source checkout (scripts import the library, not back): {bad}"
