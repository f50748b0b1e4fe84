"""Every path and every ``pycoll.`` name that the docs and docstrings point a reader to exists.

A newcomer follows these pointers first; a stale one (a module moved or renamed) sends them
looking for a file that is not there. Like ``test_layers`` for imports, this reads the text
of the repository itself: the README, docs/, and the source and test files, and checks

- repository paths (``pycoll/...``, ``tests/...``, ``tools/...``, ``docs/...``, ``ddp/...``)
  that name a file by its extension, and package-relative module paths (``core/work.py``):
  the file exists;
- ``test_*.py`` file names: the test file exists;
- dotted names ``pycoll.a.b``: they import, or are attributes of what imports.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("pycoll", "tests", "tools", "docs", "ddp", ".ci")
SUBPACKAGES = tuple(p.name for p in (ROOT / "pycoll").iterdir() if (p / "__init__.py").exists())
EXT = r"\.(?:py|md|png|toml)"

REPO_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, TOP))})/[\w./-]*?\w{EXT})\b")
PACKAGE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(SUBPACKAGES)})/[\w/]*?\w\.py)\b")
TEST_FILE = re.compile(r"(?<![\w./-])(test_\w+\.py)\b")
DOTTED = re.compile(r"(?<![\w.])(pycoll(?:\.[A-Za-z_]\w*)+)")


def _texts() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("pycoll", "tests", "tools", "ddp"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return [p for p in found if p.name != Path(__file__).name]   # its own examples are stale on purpose


def _pointers() -> list[tuple[str, int, str, str]]:
    out = []
    for path in _texts():
        rel = str(path.relative_to(ROOT))
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for kind, pattern in (("path", REPO_PATH), ("package", PACKAGE_PATH),
                                  ("test", TEST_FILE), ("name", DOTTED)):
                for m in pattern.finditer(line):
                    out.append((rel, n, kind, m.group(1)))
    return out


def _exists(kind: str, token: str) -> bool:
    if kind == "path":
        return (ROOT / token).exists()
    if kind == "package":
        return (ROOT / "pycoll" / token).exists()
    if kind == "test":
        return any((ROOT / "tests").rglob(token))
    return _resolves(token)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        module = ROOT.joinpath(*parts[:k])
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            if module.with_suffix(".py").exists() or (module / "__init__.py").exists():
                return True   # there, needing an optional extra (mpi4py, cupy) to import
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_texts_hold_pointers():
    """The patterns match what the docs write (a regex that matched nothing would pass)."""
    kinds = {kind for _, _, kind, _ in _pointers()}
    assert kinds == {"path", "package", "test", "name"}


def test_every_pointer_exists():
    pytest.importorskip("torch")
    stale = sorted({f"{rel}:{n}: {token}" for rel, n, kind, token in _pointers()
                    if not _exists(kind, token)})
    assert not stale, "docs and docstrings point to what does not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize("token,kind,exists", [
    ("pycoll/core/work.py", "path", True), ("pycoll/kernels.py", "path", False),
    ("core/work.py", "package", True), ("transport/shm.py", "package", False),
    ("test_layers.py", "test", True), ("test_tcp_spin.py", "test", False),
    ("pycoll.core.work", "name", True), ("pycoll.PeerClosedError", "name", True),
    ("pycoll.torch_backend", "name", False),
])
def test_the_check_tells_stale_from_true(token, kind, exists):
    assert _exists(kind, token) is exists
