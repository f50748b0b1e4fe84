"""``pycoll/settings.py`` is the one table of ``PYCOLL_*`` variables: the code reads them only
through it, the README's table lists exactly its names with its defaults, and a bad value is
refused with the variable's name."""

from __future__ import annotations

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


def test_no_module_reads_a_pycoll_variable_around_the_table():
    readers = re.compile(r"(?:environ\.get\(|getenv\(|environ\[)\s*[\"']PYCOLL_\w+[\"']\]?")

    def reads(line: str) -> bool:   # os.environ["PYCOLL_X"] = v (a tool setting one) is no read
        return any(not (m.group().endswith("]") and re.match(r"\s*=(?!=)", line[m.end():]))
                   for m in readers.finditer(line))

    bad = []
    for top in ("pycoll", "ddp"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name == "settings.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if reads(line):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


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
    assert settings.raw("PYCOLL_AUTH_KEY", {"PYCOLL_AUTH_KEY": ""}) == ""   # set, though empty
    assert settings.raw("PYCOLL_AUTH_KEY", {}) is None


def test_the_environment_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv("PYCOLL_SEGMENT_BYTES", "65536")
    assert settings.get("PYCOLL_SEGMENT_BYTES") == 65536
    monkeypatch.delenv("PYCOLL_SEGMENT_BYTES")
    assert settings.get("PYCOLL_SEGMENT_BYTES") == 4 << 20


def test_a_bad_value_names_the_variable():
    with pytest.raises(ValueError, match=r"PYCOLL_SHM_SLOT_BYTES='4M'.*default 4 MiB"):
        settings.get("PYCOLL_SHM_SLOT_BYTES", {"PYCOLL_SHM_SLOT_BYTES": "4M"})
    with pytest.raises(KeyError):
        settings.get("PYCOLL_NO_SUCH_THING")
