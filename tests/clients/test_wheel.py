"""The package carries what its commands need: build the wheel, install it into a fresh venv,
and run every ``python -m pycoll ...`` command from a folder outside the checkout.

People comparing backends ``pip install`` pycoll; a command that only works next to a source
checkout (as ``bench`` once did, through ``tools/``) is broken for them. So the wheel is built
from a copy of the checkout (nothing is written into the shared working tree), installed with
pip into a venv that sees the system's torch/numpy/msgpack (``--system-site-packages``) but
must not see the editable checkout, and each command runs there in a small configuration.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

from pycoll.__main__ import COMMANDS

REPO = Path(__file__).resolve().parents[2]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
# Whatever a build or a test run leaves in a checkout; none of it belongs in the wheel's input.
NOT_SOURCE = (".git", "__pycache__", "*.egg-info", "build", "dist", ".venv*", ".pytest_cache",
              ".hypothesis", ".ruff_cache", ".benchmarks", "out")

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("setuptools") is None
                       or importlib.util.find_spec("pip") is None,
                       reason="building the wheel offline needs pip and setuptools installed"),
]


class Installed:
    """A venv with the wheel installed, and a work folder outside the checkout to run in."""

    def __init__(self, root: Path):
        self.root = root
        self.python = root / "venv" / "bin" / "python"
        self.site = Path(subprocess.check_output(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True, env=self.env(), cwd=root).strip()).resolve()
        self.work = root / "work"
        self.work.mkdir()

    @staticmethod
    def env(**extra) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
        env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
        return env

    def run(self, *args, timeout=60, env=None, program=None):
        """Run ``python -m pycoll ARGS`` (or ``program ARGS``) in the work folder."""
        cmd = [str(program)] if program else [str(self.python), "-m", "pycoll"]
        proc = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True,
                              timeout=timeout, cwd=self.work, env=env or self.env(),
                              check=False)
        assert proc.returncode == 0, (cmd + list(args), proc.stdout[-3000:],
                                      proc.stderr[-3000:])
        return proc.stdout


def _build(root: Path) -> Path:
    # Built from a copy: pip builds in the source tree (build/, *.egg-info), and the checkout is
    # shared with whatever else runs at the same time.
    src = root / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist), str(src)],
                   check=True, timeout=120, env=Installed.env(), cwd=root)
    (wheel,) = dist.glob("pycoll-*.whl")
    return wheel


def _make_venv(root: Path, wheel: Path) -> None:
    target = root / "venv"
    venv.create(target, system_site_packages=True, with_pip=False)  # pip: the system's
    if sys.prefix != sys.base_prefix:
        # The tests run in a venv themselves: "system" would mean the base interpreter, which
        # lacks this venv's torch. Its folders go after the new venv's own site-packages.
        purelib = subprocess.check_output(
            [target / "bin" / "python", "-c",
             "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
        Path(purelib, "_pycoll_outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: the editable pycoll of the outer environment is neither uninstalled
    # nor taken as already there; the venv's own copy comes first on sys.path.
    subprocess.run([target / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index",
                    "--ignore-installed", "-q", str(wheel)],
                   check=True, timeout=120, env=Installed.env(), cwd=root)


@pytest.fixture(scope="module")
def installed():
    root = Path(tempfile.mkdtemp(prefix="pycoll-wheel-"))
    try:
        _make_venv(root, _build(root))
        yield Installed(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_venv_imports_the_wheel_not_the_checkout(installed):
    modules = ["ddp", "pycoll", "pycoll.cli.demo", "pycoll.cli.draw", "pycoll.cli.trace_view",
               "pycoll.cli.doctor", "pycoll.cli.bench.launch", "pycoll.cli.bench.worker"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print('\\n'.join(m.__file__ for m in list(sys.modules.values())"
            " if getattr(m, '__file__', None)))\n")
    # (absolute paths only: torch.ops and torch.classes carry a bare '_ops.py')
    files = [Path(f).resolve() for f in
             installed.run("-c", code, program=installed.python).splitlines()
             if os.path.isabs(f)]
    # The outer environment (torch, numpy) may itself live in the checkout (.ci/run's venvs).
    outer = [Path(p).resolve() for p in site.getsitepackages()]
    assert not [f for f in files if REPO in f.parents and not any(o in f.parents for o in outer)], \
        "the venv imported from the checkout"
    ours = {f.relative_to(installed.site).as_posix() for f in files if installed.site in f.parents}
    assert {"ddp/__init__.py", "pycoll/__init__.py", "pycoll/cli/bench/launch.py",
            "pycoll/cli/bench/worker.py"} <= ours, sorted(ours)


def test_help_lists_every_command_and_the_console_script_works(installed):
    out = installed.run("--help")
    assert all(f"  {name} " in out for name in COMMANDS), out
    assert installed.run("--help", program=installed.python.parent / "pycoll") == out


def test_bench(installed):
    out_json, png = installed.work / "bench.json", installed.work / "bench.png"
    plot = ["--plot", png] if HAS_MPL else []
    text = installed.run("bench", "--backends", "pycoll,gloo", "--mpi", "off", *plot,
                         "-c", "all_reduce,barrier", "--world-size", "2", "--min-bytes", "8",
                         "--max-bytes", "64", "--step-factor", "8", "--iters", "2",
                         "--warmup", "1", "--rounds", "1", "--ref-seconds", "0",
                         "--timeout", "20", "--deadline", "50", "--no-progress",
                         "--json", out_json, timeout=60)
    assert "# all_reduce" in text and "#wrong total: 0 OK" in text, text
    result = json.loads(out_json.read_text())
    assert result["meta"]["backends"] == ["pycoll", "gloo"]
    rows = result["collectives"]["all_reduce"]["rows"]
    assert [r["size"] for r in rows] == [8, 64]
    for row in rows:
        for backend in ("pycoll", "gloo"):
            r = row["results"][backend]
            assert r["wrong"] == 0 and r["error"] is None and r["iters"] == 2, (backend, r)
    if HAS_MPL:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_recorded_and_trace(installed):
    traces = installed.work / "trace"
    out = installed.run("demo", "--steps", "2", timeout=120,
                        env=installed.env(PYCOLL_TRACE=str(traces)))
    assert "parameters identical on all ranks: yes" in out, out
    assert "\nchecks: all passed" in out, out
    assert sorted(p.name for p in traces.glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]
    chrome = installed.work / "trace.json"
    installed.run("trace", traces, "-o", chrome)
    events = json.loads(chrome.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)
    assert {e["pid"] for e in events if e["ph"] == "X"} >= {0, 1}


def test_draw(installed):
    out = installed.run("draw", "all_reduce/ring", "-n", "4", "--text")
    assert "6 rounds, 24 transfers" in out, out  # 2(P-1) steps, P transfers each
    if HAS_MPL:
        png = installed.work / "ring.png"
        installed.run("draw", "all_reduce/ring", "-n", "4", "-o", png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_doctor(installed):
    checks = {r["check"]: r for r in json.loads(installed.run("doctor", "--json"))}
    assert checks["loopback tcp"]["status"] == "ok"
    assert "paths" in checks


def test_cuda_bench_command_is_in_the_wheel(installed):
    # docs/cuda.md's GPU benchmark; --help only: a full run needs a GPU and minutes.
    out = installed.run("-m", "pycoll", "cuda-bench", "--help", program=installed.python)
    assert "--max-bytes" in out and "python -m pycoll cuda-bench" in out


def test_every_command_has_a_test_here():
    tested = {"demo", "bench", "draw", "trace", "doctor", "cuda-bench"}
    assert set(COMMANDS) == tested, "a new `python -m pycoll` command needs a test in this file"
