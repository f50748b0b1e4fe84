"""Tests of the benchmark (``pycoll.cli.bench``): pure parts in process, tiny real sweeps as
subprocesses of ``python -m pycoll bench``.

Nothing here asserts on absolute times (the machine is shared); only shapes, counts and #wrong.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pycoll.cli.bench import launch as bench
from pycoll.cli.bench.collectives import COLLECTIVES
from pycoll.cli.bench.harness import run_sweep, split_rounds, sweep_plan

REPO = Path(__file__).resolve().parents[2]
ALL = list(COLLECTIVES)


def test_sizes_parse_and_sweep():
    assert bench.parse_size("8") == 8
    assert bench.parse_size("64K") == bench.parse_size("64KiB") == 65536
    assert bench.parse_size("64M") == 64 << 20
    assert bench.size_sweep(8, 64 << 20, 4)[-1] == 32 << 20
    assert bench.size_sweep(8, 64, 2) == [8, 16, 32, 64]
    with pytest.raises(ValueError):
        bench.size_sweep(64, 8, 2)


def test_bus_factors_are_nccl_tests_ones():
    f = {name: c.bus_factor(4) for name, c in COLLECTIVES.items()}
    assert f["all_reduce"] == 1.5
    assert f["all_gather"] == f["reduce_scatter"] == f["all_to_all"] == 0.75
    assert f["broadcast"] == f["reduce"] == f["sendrecv"] == 1.0


def test_plan_rounds_blocks_and_dedups():
    cfg = {"collectives": ["all_gather", "barrier"], "sizes": [4, 8, 16], "dtype": "float32"}
    # world 4, float32: 4 and 8 bytes both round up to one element per rank
    assert sweep_plan(cfg, 4) == [("all_gather", 4, 16), ("barrier", 0, 0)]
    assert split_rounds(10, 4) == [3, 3, 2, 2] and split_rounds(2, 4) == [1, 1]


class _World1:
    """Verbs for a world of one rank, done right (``broken``: outputs left untouched)."""

    def __init__(self, broken=False, fail=()):
        self.broken, self.fail = broken, fail

    def __getattr__(self, verb):
        def run(*args):
            if verb in self.fail:
                raise RuntimeError(f"{verb} not implemented")
            if self.broken or verb in ("all_reduce", "broadcast", "reduce", "barrier"):
                return  # with one rank, in-place collectives have nothing to do
            out, inp = args[0], args[1]
            out.copy_(inp)
        return run


def _sweep(api, names, iters=3):
    cfg = {"collectives": names, "sizes": [8, 64], "dtype": "int32", "op": "sum",
           "iters": iters, "warmup": 1, "rounds": 2}
    return run_sweep(cfg, 0, 1, {"x": api}, agree=lambda flags: flags)


def test_harness_counts_no_wrong_for_a_correct_backend():
    names = [n for n in ALL if n != "sendrecv"]
    recs = _sweep(_World1(), names)
    assert {r["collective"] for r in recs} == set(names)
    assert all(r["wrong"] == 0 and r["error"] is None and len(r["times_us"]) == 3 for r in recs)


def test_harness_counts_wrong_elements_of_a_broken_backend():
    recs = _sweep(_World1(broken=True), ["all_gather", "all_to_all", "gather", "scatter"])
    # outputs are sentinel-filled before the first and last iteration: both checks see them
    assert all(r["wrong"] == 2 * r["count"] for r in recs), recs


def test_harness_reports_an_error_and_skips_the_rest_of_that_collective():
    recs = _sweep(_World1(fail=("all_gather",)), ["all_gather", "all_to_all"])
    ag = [r for r in recs if r["collective"] == "all_gather"]
    assert "not implemented" in ag[0]["error"] and "skipped" in ag[1]["error"]
    assert all(r["error"] is None for r in recs if r["collective"] == "all_to_all")


def test_harness_drops_a_backend_that_failed_on_another_rank():
    cfg = {"collectives": ["all_gather"], "sizes": [8, 64], "dtype": "int32", "op": "sum",
           "iters": 2, "warmup": 1, "rounds": 1}
    calls = []

    def agree(flags):  # the 2nd agreement (y's warmup) is where another rank reports failure
        calls.append(1)
        return [False, True] if len(calls) == 2 else flags

    recs = run_sweep(cfg, 0, 1, {"x": _World1(), "y": _World1()}, agree)
    by = {(r["backend"], r["size"]): r for r in recs}
    assert by["y", 8]["error"] == "failed on another rank" and by["y", 8]["times_us"] == []
    assert "skipped" in by["y", 64]["error"] and by["y", 64]["times_us"] == []
    assert by["x", 8]["error"] is None and len(by["x", 64]["times_us"]) == 2


def test_main_is_importable_and_plot_error_is_clear(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0 and "--max-bytes" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match="pip install"):
        # a tiny sweep, in case the early check ever regresses and the run goes ahead
        bench.main(["--plot", "x.png", "--backends", "gloo", "-c", "barrier", "--iters", "1",
                    "--ref-seconds", "0", "--mpi", "off", "--deadline", "20"])


def _run_bench(tmp_path, *extra):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "pycoll", "bench", "--world-size", "2",
           "--min-bytes", "8", "--max-bytes", "4K", "--step-factor", "512", "--iters", "3",
           "--warmup", "1", "--rounds", "2", "--ref-seconds", "0.1", "--timeout", "20",
           "--deadline", "50", "--no-progress", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=55, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _check_rows(result, backend, collectives):
    assert list(result["collectives"]) == collectives
    for name in collectives:
        rows = result["collectives"][name]["rows"]
        assert [r["size"] for r in rows] == ([0] if name == "barrier" else [8, 4096])
        for row in rows:
            r = row["results"][backend]
            assert r["wrong"] == 0 and r["error"] is None, (name, r)
            assert r["iters"] == 3 and r["time_us"] > 0 and "busbw_GBps" in r


@pytest.mark.timeout(60)
def test_bench_tiny_sweep_gloo_and_pycoll(tmp_path):
    plot = importlib.util.find_spec("matplotlib") is not None
    extra = ["--plot", str(tmp_path / "out.png")] if plot else []
    result, stdout = _run_bench(tmp_path, "--backends", "pycoll,gloo", "--mpi", "off", *extra)
    assert result["meta"]["backends"] == ["pycoll", "gloo"]
    ref = result["reference"]
    assert set(ref) >= {"memcpy_GBps", "tcp_loopback_one_way_GBps", "memcpy_per_rank_GBps"}
    # world 2: each rank at least reads its input and writes its output: one copy of n bytes
    assert ref["all_reduce_shm_bound_busbw_GBps"] == pytest.approx(ref["memcpy_per_rank_GBps"])
    _check_rows(result, "gloo", ALL)
    for entry in result["collectives"].values():
        for row in entry["rows"]:
            py = row["results"]["pycoll"]
            if py is None:  # pycoll not usable yet: the reason must be in a note
                assert "pycoll" in result["notes"]
            else:  # a collective pycoll lacks may error, but it must never be wrong
                assert py["wrong"] == 0
                assert ("time_us" in py) == ("pycoll/gloo" in row["speed_ratio"])
    assert "# all_reduce" in stdout and "pycoll/gloo" in stdout and "#wrong total: 0" in stdout
    if plot:
        assert (tmp_path / "out.png").stat().st_size > 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="mpirun and mpi4py not installed (optional)")
def test_bench_mpi_column(tmp_path):
    names = ["all_reduce", "reduce_scatter", "gather", "barrier", "sendrecv"]
    result, _ = _run_bench(tmp_path, "--backends", "gloo", "--mpi", "on",
                           "--collectives", ",".join(names), "--ref-seconds", "0")
    assert result["meta"]["backends"] == ["gloo", "mpi"]
    _check_rows(result, "mpi", names)
    _check_rows(result, "gloo", names)

