"""The tests are laid out as a newcomer expects: one folder per kind (unit, ranks, clients), shared
helpers only in ``tests/support`` (or the shipped ``pycoll.testing``), no test module importing
another, and every ``test_*.py`` holding tests."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
KINDS = {"unit", "ranks", "clients"}


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_file_sits_in_a_kind_folder():
    assert {p.parent.name for p in _test_files()} == KINDS
    assert not list(TESTS.glob("test_*.py")), "a test file at the top of tests/: put it in its kind's folder"


def test_no_test_module_imports_another():
    bad = []
    for path in [*_test_files(), *(TESTS / "support").glob("*.py"), TESTS / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[-1].startswith("test_") and n.startswith("tests") for n in names):
                bad.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not bad, "import helpers from tests.support or pycoll.testing, not from a test module: " + ", ".join(bad)


def test_every_test_file_holds_tests():
    empty = [p.relative_to(TESTS) for p in _test_files()
             if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
                        for n in ast.walk(ast.parse(p.read_text())))]
    assert not empty, empty
