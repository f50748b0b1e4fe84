"""``pycoll/settings.py`` is the one table of ``PYCOLL_*`` variables: the code reads them only
through it, the README's table lists exactly its names with its defaults, and a bad value is
refused with the variable's name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pycoll import settings

ROOT = Path(__file__).resolve().parents[2]


def _readme_rows() -> dict[str, str]:
    """variable -> its default cell, from the README's settings table."""
    text = (ROOT / "README.md").read_text()
    table = text.split("### Settings", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and "PYCOLL_" in cells[0]:
            for name in re.findall(r"PYCOLL_\w+", cells[0]):
                rows[name] = cells[2]
    return rows


def test_the_readme_table_is_the_settings_table():
    rows = _readme_rows()
    assert sorted(rows) == sorted(settings.SETTINGS)
    wrong = {name: (cell, settings.SETTINGS[name].shown) for name, cell in rows.items()
             if not cell.startswith(settings.SETTINGS[name].shown)}
    assert not wrong, f"README default cell vs settings.py (cell, shown): {wrong}"


def _environment_reads(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, variable name or None if not a constant) of every read of the environment:
    ``os.environ.get(x)``, ``os.getenv(x)``, ``os.environ[x]`` not assigned to; ``x`` a
    string or a module-level constant naming one."""
    consts = {t.id: n.value.value for n in getattr(tree, "body", []) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str)}

    def name_of(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return consts.get(node.id) if isinstance(node, ast.Name) else None

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    stored = {id(t) for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])}
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv"):
            reads.append((node.lineno, name_of(node.args[0])))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and id(node) not in stored:
            reads.append((node.lineno, name_of(node.slice)))
    return reads


def test_no_module_reads_a_pycoll_variable_around_the_table():
    bad = []
    for top in ("pycoll", "ddp"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name == "settings.py":
                continue
            for line, name in _environment_reads(ast.parse(path.read_text())):
                if name is not None and name.startswith("PYCOLL_"):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not bad, "read PYCOLL_* settings through pycoll.settings.get:\n" + "\n".join(bad)


def test_the_environment_check_sees_every_form_of_read():
    tree = ast.parse("import os\nENV = 'PYCOLL_A'\nos.environ.get(ENV)\nos.getenv('PYCOLL_B')\n"
                     "x = os.environ['PYCOLL_C']\nos.environ['PYCOLL_D'] = '1'\n")
    assert sorted(n for _, n in _environment_reads(tree)) == ["PYCOLL_A", "PYCOLL_B", "PYCOLL_C"]


def test_every_name_the_code_asks_for_is_declared():
    asked = set()
    for top in ("pycoll", "ddp"):
        for path in (ROOT / top).rglob("*.py"):
            asked |= set(re.findall(r"settings\.(?:get|raw)\(\s*\"(PYCOLL_\w+)\"", path.read_text()))
    assert asked and asked <= set(settings.SETTINGS), asked - set(settings.SETTINGS)


def test_values_parse_and_defaults_apply():
    env = {"PYCOLL_SHM_SLOT_BYTES": "8192", "PYCOLL_TCP_SPIN_US": " 250 ", "PYCOLL_TRANSPORT": ""}
    assert settings.get("PYCOLL_SHM_SLOT_BYTES", env) == 8192
    assert settings.get("PYCOLL_TCP_SPIN_US", env) == 250.0
    assert settings.get("PYCOLL_TRANSPORT", env) == "auto"          # blank: the default
    assert settings.get("PYCOLL_SEGMENT_BYTES", {}) == 4 << 20
    for text, value in (("4M", 4 << 20), ("4MiB", 4 << 20), ("256 KB", 256 << 10), ("1g", 1 << 30)):
        assert settings.get("PYCOLL_SEGMENT_BYTES", {"PYCOLL_SEGMENT_BYTES": text}) == value
    assert settings.raw("PYCOLL_AUTH_KEY", {"PYCOLL_AUTH_KEY": ""}) == ""   # set, though empty
    assert settings.raw("PYCOLL_AUTH_KEY", {}) is None


def test_the_environment_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv("PYCOLL_SEGMENT_BYTES", "65536")
    assert settings.get("PYCOLL_SEGMENT_BYTES") == 65536
    monkeypatch.delenv("PYCOLL_SEGMENT_BYTES")
    assert settings.get("PYCOLL_SEGMENT_BYTES") == 4 << 20


def test_a_bad_value_names_the_variable():
    with pytest.raises(ValueError, match=r"PYCOLL_SHM_SLOT_BYTES='4 megs'.*default 4 MiB"):
        settings.get("PYCOLL_SHM_SLOT_BYTES", {"PYCOLL_SHM_SLOT_BYTES": "4 megs"})
    with pytest.raises(ValueError, match=r"PYCOLL_SEGMENT_BYTES='-1'"):
        settings.get("PYCOLL_SEGMENT_BYTES", {"PYCOLL_SEGMENT_BYTES": "-1"})
    with pytest.raises(KeyError):
        settings.get("PYCOLL_NO_SUCH_THING")
