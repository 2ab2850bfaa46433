"""Every error class lives in one place: fate_edge/errors.py (the daemon's HTTP-side ones in apps/server/errors.py)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ERROR_MODULES = {REPO / "fate_edge" / "errors.py", REPO / "fate_edge" / "apps" / "server" / "errors.py"}
EXCEPTION_BASES = {"Exception", "ValueError", "RuntimeError", "OSError", "KeyError", "TypeError"}


def _exception_classes(path: Path, known: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if bases & (EXCEPTION_BASES | known) or node.name.endswith(("Error", "Exception")):
                found.append(node.name)
    return found


def test_no_error_class_is_defined_outside_the_errors_modules():
    known: set[str] = set()
    for module in ERROR_MODULES:
        known |= set(_exception_classes(module, set()))
    assert {"FateEdgeError", "BudgetError", "FetchError", "ContextLengthError", "APIError"} <= known
    stray = {}
    for root in ("fate_edge", "predictors", "quant", "devices"):
        for path in (REPO / root).rglob("*.py"):
            if path not in ERROR_MODULES and (names := _exception_classes(path, known)):
                stray[str(path.relative_to(REPO))] = names
    assert stray == {}, f"move these error classes into fate_edge/errors.py: {stray}"
