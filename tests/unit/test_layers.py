"""The folders are the layers: imports point down only, no module imports another in a cycle,
no module takes another module's private name, and no module grows past ~400 lines.

The import graph is read from the source (every ``import`` and ``from ... import``, also those
inside functions), so the test needs nothing imported and sees what a reader sees.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Top to bottom. A module may import its own layer's modules and any lower layer's.
LAYERS = [
    ["pycoll.cli", "pycoll.__main__"],
    ["pycoll.testing"],               # the test kit and the launcher: may use anything; only the CLI uses it
    ["ddp"],
    ["pycoll"],                       # the package root: the public names
    ["pycoll.partial"],
    ["pycoll.c10d", "pycoll.shm.shared"],   # shm.shared: empty_shared, the torch-facing part of shm/
    ["pycoll.cuda"],
    ["pycoll.observe"],
    ["pycoll.core", "pycoll.shm"],   # shm/: what runs on one host (arena, barriers, its algorithms)
    ["pycoll.algorithms", "pycoll.transport"],
    ["pycoll.wire", "pycoll.rendezvous", "pycoll.callbacks", "pycoll.torch_compat", "pycoll.errors"],
    ["pycoll.settings"],              # read by every layer; reads only the environment
]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("pycoll", "ddp"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _layer(mod: str) -> int:
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and len(name) > depth:
                best, depth = i, len(name)
    assert best is not None, f"{mod} belongs to no layer: add it to LAYERS"
    return best


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    pkg = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
    base = pkg[:len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges():
    """(importer, imported module, names taken, line) for every import of our own modules."""
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES:
                        yield mod, a.name, [], node.lineno
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, node)
                if target not in MODULES:
                    continue
                names = []
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in MODULES:
                        yield mod, sub, [], node.lineno
                    else:
                        names.append(a.name)
                if names:
                    yield mod, target, names, node.lineno


EDGES = list(_edges())


def test_every_import_points_down():
    up = [f"{src} (layer {_layer(src)}) imports {dst} (layer {_layer(dst)}), line {line}"
          for src, dst, _, line in EDGES if _layer(dst) < _layer(src)]
    assert not up, "\n".join(up)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _, _ in EDGES:
        if src != dst and dst != "pycoll":   # (every module's import runs the root package first)
            graph[src].add(dst)
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_takes_another_modules_private_name():
    bad = [f"{src} takes {n} from {dst}, line {line}" for src, dst, names, line in EDGES
           for n in names if n.startswith("_") and not n.startswith("__") and dst != src]
    assert not bad, "\n".join(bad)


def test_no_module_over_the_size_limit():
    big = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    over = {m: n for m, n in big.items() if n > MAX_LINES}
    assert not over, over


def test_the_layer_table_covers_every_package():
    for mod in MODULES:
        _layer(mod)


def test_the_readme_lists_the_layers_in_this_order():
    """The README's folder list ("How it is built") names the layers top to bottom as here."""
    text = (ROOT / "README.md").read_text().split("## How it is built", 1)[1]
    block = text.split("```", 2)[1]
    named = [line.split()[0].rstrip("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
             for line in block.splitlines() if line[:1].strip()]
    layers = [_layer(m) for m in named]
    assert layers == sorted(layers), list(zip(named, layers))
    assert {n for n in named} >= {name for names in LAYERS for name in names} - {"pycoll.__main__"}



def test_private_torch_is_reached_only_through_torch_compat():
    """torch's private names (``dist._x``, ``c10d._x``, ``torch._x``, ``pg._get_backend``,
    storage IPC) appear in code only in ``pycoll/torch_compat.py``: one place to mend when
    torch moves them."""
    import re
    private = re.compile(r"\b(?:dist|c10d|distributed_c10d|torch)\._[a-zA-Z]|\._get_backend\b|"
                         r"\._share_cuda_\b|\._new_shared_cuda\b")
    bad = []
    for mod, path in MODULES.items():
        if mod == "pycoll.torch_compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and private.search(ast.unparse(node)):
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(sorted(set(bad)))
