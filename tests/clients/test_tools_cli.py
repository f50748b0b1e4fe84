"""The tool commands: ``python -m pycoll draw | doctor | bench``, each run as a subprocess.

``draw --text`` is checked against counts derived from the schedules themselves (rounds,
transfers = sends, local actions), so the table cannot drift from what the executor runs.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pycoll.algorithms import ALGORITHMS
from pycoll.algorithms.schedule import COMM, RecvReduce, Send
from pycoll.cli.draw import build, resolve, timeline

REPO = Path(__file__).resolve().parents[2]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _pycoll(*args, timeout=50, cwd=REPO):
    proc = subprocess.run([sys.executable, "-m", "pycoll", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _check_table(text, collective, algo, world):
    scheds = build(collective, algo, world)
    acts = [a for s in scheds for st in s.steps for a in st]
    sends = sum(isinstance(a, Send) for a in acts)
    reduces = sum(isinstance(a, RecvReduce) for a in acts)
    local = sum(not isinstance(a, COMM) for a in acts)
    rows = [ln.split() for ln in text.splitlines() if ln and ln[0] not in "#r"]
    assert len(rows) == sends + local, (collective, algo, world)
    assert sum(r[3] in ("recv", "recv+reduce") for r in rows) == sends
    assert sum(r[3] == "recv+reduce" for r in rows) == reduces
    assert f"{sends} transfers ({reduces} receive-reduce" in text
    rounds = timeline(collective, algo, world).n_rounds
    assert f"# {rounds} rounds" in text and {int(r[0]) for r in rows} == set(range(rounds))


@pytest.mark.timeout(60)
def test_draw_text_lists_every_transfer_and_local_action_of_the_schedules():
    out = _pycoll("draw", "--text", "--all", "--worlds", "4,5")  # one process, every algorithm
    tables = out.strip().split("\n\n")
    jobs = [(c, a, w) for c in ALGORITHMS for a in ALGORITHMS[c] for w in (4, 5)]
    assert len(tables) == len(jobs)
    for text, (collective, algo, world) in zip(tables, jobs):
        assert text.startswith(f"# {collective} / {algo}") and f"world {world}," in text
        _check_table(text, collective, algo, world)
    ring = _pycoll("draw", "ring_allreduce", "-n", "4", "--text")  # module names work too
    assert "6 rounds, 24 transfers" in ring  # 2(P-1) steps, P transfers each
    _check_table(ring, "all_reduce", "ring", 4)


def test_timeline_matches_transfers_and_places_both_ends_in_one_round():
    tl = timeline("all_reduce", "recursive_doubling", 5)
    assert len(tl.transfers) == sum(isinstance(a, Send) for s in tl.schedules
                                    for st in s.steps for a in st)
    for t in tl.transfers:
        assert t.send.count == t.recv.count and t.send.peer == t.dst and t.recv.peer == t.src
    assert tl.n_rounds == 6  # fold in, log2(4) rounds of exchange + reduce, fold out
    with pytest.raises(ValueError, match="--collective"):
        resolve("ring")
    assert resolve("ring", "all_gather") == ("all_gather", "ring")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_MPL, reason="matplotlib (the 'plot' extra) not installed")
def test_draw_writes_a_png_and_an_svg(tmp_path):
    png, svg = tmp_path / "ring.png", tmp_path / "tree.svg"
    _pycoll("draw", "all_reduce/ring", "-n", "8", "-o", str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 1000 and height > 500  # 8 ranks, 14 rounds on two bands: room to read
    _pycoll("draw", "tree", "-n", "5", "-o", str(svg))
    assert "<svg" in svg.read_text()[:500]


@pytest.mark.timeout(60)
def test_doctor_table_and_json():
    rows = json.loads(_pycoll("doctor", "--json"))
    checks = {r["check"]: r for r in rows}
    assert {"python", "torch", "cpus", "shared memory", "cross-memory attach", "cuda", "cupy",
            "ip netns", "mpi", "matplotlib", "loopback tcp", "PYCOLL_* settings",
            "paths"} <= set(checks)
    assert checks["loopback tcp"]["status"] == "ok"
    assert all(r["status"] in ("ok", "no", "info") and r["detail"] for r in rows)


def test_doctors_shared_memory_probe_leaves_nothing():
    """The probe shares a real memfd with a child: afterwards neither is left (the memfd has
    no /dev/shm name to look for; its mappings and descriptors are what could leak)."""
    from pycoll.cli.doctor import OK, check_shm
    from pycoll.testing.ranks import pycoll_memory

    before = pycoll_memory()
    status, detail, _ = check_shm()
    assert status == OK, detail
    assert pycoll_memory() == before


@pytest.mark.timeout(60)
def test_bench_subcommand_runs_from_any_folder(tmp_path):
    out = tmp_path / "bench.json"
    text = _pycoll("bench", "--backends", "gloo", "--mpi", "off", "-c", "all_reduce",
                   "--world-size", "2", "--min-bytes", "8", "--max-bytes", "64",
                   "--step-factor", "8", "--iters", "2", "--warmup", "1", "--rounds", "1",
                   "--ref-seconds", "0", "--timeout", "20", "--deadline", "45",
                   "--no-progress", "--json", str(out), timeout=55, cwd=tmp_path)
    assert "#wrong total: 0" in text
    rows = json.loads(out.read_text())["collectives"]["all_reduce"]["rows"]
    assert [r["size"] for r in rows] == [8, 64]


def _demo_results(world=2, test_acc=0.86, ok=True, diff=0.0):
    """What the demo's ranks send to the parent, made up: for the report's checks alone."""
    row = {"name": "all_reduce", "bytes": 16, "ok": {"pycoll": ok, "gloo": True}, "same": ok,
           "us": {"pycoll": [10.0, 12.0, 11.0], "gloo": [30.0, 20.0, 40.0]}}
    run = {"blocks": [(20, 0.02), (20, 0.04)], "curve": [(0, 0.25), (20, 0.5), (40, test_acc)],
           "train_acc": 0.9, "test_acc": test_acc, "loss": (1.4, 0.2), "identical_on_ranks": True}
    ddp = {"pycoll": run, "gloo": run, "max_param_diff": diff, "same_predictions": 1.0}
    return {r: ([row], ddp) for r in range(world)}


def test_demo_report_fails_on_a_wrong_collective_a_model_that_did_not_learn_or_models_apart():
    from pycoll.cli import demo, demo_task

    assert demo.report_collectives(_demo_results(), rounds=3) == 0
    assert demo.report_collectives(_demo_results(ok=False), rounds=3) == 1
    assert demo.report_training(_demo_results(), steps=demo_task.MIN_STEPS) == []
    low = demo.report_training(_demo_results(test_acc=0.5), steps=demo_task.MIN_STEPS)
    assert low and "did not learn" in low[0]
    assert demo.report_training(_demo_results(test_acc=0.5), steps=2) == []  # too short to judge
    apart = demo.report_training(_demo_results(diff=1.0), steps=demo_task.MIN_STEPS)
    assert apart == ["the pycoll and gloo models differ"]


@pytest.mark.timeout(120)
def test_demo_checks_every_collective_on_pycoll_and_gloo_and_the_model_learns():
    """The README's first command runs ``python -m pycoll demo``: every check must pass."""
    from pycoll.cli.demo_task import THRESHOLD

    out = _pycoll("demo", timeout=110)
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("collective "))
    assert "pycoll us" in lines[head] and "gloo us" in lines[head], out
    rows = [ln.split() for ln in lines[head + 1:] if ln and not ln.startswith("(")]
    rows = rows[:next(i for i, r in enumerate(rows) if r[0] == "torch")]
    assert len(rows) >= 10, out
    for r in rows:   # ... pycoll us, gloo us, speed-up, correct, same as gloo
        assert r[-2:] == ["yes", "yes"] and float(r[-5]) > 0 and float(r[-4]) > 0, (r, out)
    trained = {ln.split()[0]: ln.split() for ln in lines
               if ln.startswith(("pycoll ", "gloo ")) and " -> " in ln and ln.endswith("%")}
    assert set(trained) == {"pycoll", "gloo"}, out
    for backend, r in trained.items():  # backend, steps/s, loss -> loss, train acc, test acc
        assert float(r[1]) > 0 and float(r[-1].rstrip("%")) / 100 >= THRESHOLD, (backend, out)
    assert "pycoll and gloo final models: identical" in out or "models: agree" in out, out
    assert "parameters identical on all ranks: yes" in out, out
    assert "\nchecks: all passed" in out, out


def _tool(script, *args, timeout=120):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(150)
def test_bench_ddp_prints_its_tables_and_the_per_round_ratios(tmp_path):
    """The command docs/ddp.md gives for issue 20's figures, shrunk to one short round."""
    out = _tool("bench_ddp.py", "--models", "convnet", "--rounds", "1", "--steps", "1", "--warmup", "1",
                "--sweep", "25", "--sweep-models", "convnet", "--staged", "--no-memory", "--plot", "",
                "--json", str(tmp_path / "b.json"))
    assert "convnet | 0.9M |" in out and "bucket_cap_mb sweep, ours on the convnet" in out, out
    ratios = next(ln for ln in out.splitlines() if ln.startswith("convnet: "))
    for name in ("torch/gloo", "ours/pycoll", "ours-staged/pycoll", "ours/pycoll@25MB"):
        assert f"{name} " in ratios, ratios
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["opts"]["sweep_models"] == ["convnet"] and saved["speed"]["per_round"]


@pytest.mark.timeout(120)
def test_plot_load_reads_the_ratios_of_a_real_bench_run(tmp_path):
    """tools/plot_load.py's ratios come from the bench's own JSON (gloo time / pycoll time)."""
    out = tmp_path / "run.json"
    _pycoll("bench", "-c", "all_reduce", "-b", "8", "-e", "1K", "-f", "128", "--iters", "3", "--warmup", "1",
            "--mpi", "off", "--ref-seconds", "0", "--no-progress", "--load", "1", "--json", str(out), timeout=100)
    from tools.plot_load import ratios

    label, sizes, r = ratios(str(out), "all_reduce")
    rows = json.loads(out.read_text())["collectives"]["all_reduce"]["rows"]
    assert label.startswith("1 busy process") and sizes == [8, 1024] and len(r) == 2
    assert r[0] == pytest.approx(rows[0]["results"]["gloo"]["time_us"] / rows[0]["results"]["pycoll"]["time_us"])


@pytest.mark.timeout(150)
def test_bench_ddp_loader_mode_under_load(tmp_path):
    """DataLoader workers feeding each rank, one busy process beside: the floor configuration
    and the pycoll-vs-gloo verdict are printed, and the busy process is gone afterwards."""
    out = _tool("bench_ddp.py", "--models", "convnet", "--rounds", "2", "--steps", "2", "--warmup", "1",
                "--sweep", "", "--no-memory", "--loader-workers", "1", "--batch", "4", "--sample-work", "1",
                "--load", "1", "--json", str(tmp_path / "b.json"))
    assert "input: 1 DataLoader workers per rank, batch 4" in out and "load: 1 busy process" in out, out
    assert "synchronisation floor" in out and "floor/pycoll" in out, out
    assert "convnet, torch DDP: pycoll/gloo per round" in out and "(above gloo in " in out, out
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["opts"]["loader"] == 1 and saved["opts"]["load_text"].startswith("1 busy process")


@pytest.mark.timeout(150)
def test_ddp_phases_times_each_configuration_on_both_ranks():
    out = _tool("ddp_phases.py", "--model", "convnet", "--rounds", "1", "--steps", "3",
                "--configs", "indep,ours,overlap")
    for rank in (0, 1):
        assert f"rank {rank} (convnet, ms, medians)" in out, out
    for config in ("indep", "ours", "overlap"):
        assert sum(ln.split()[0] == config for ln in out.splitlines() if ln.startswith("  ")) == 2, out
    assert "ours' buckets (index, MiB, ready, reduced): [(0, " in out, out


@pytest.mark.timeout(240)
@pytest.mark.skipif(not __import__("pycoll.torch_compat").torch_compat.reconfigure_supported(),
                    reason="tools/heal.py needs torch >= 2.14 (the reconfigure API)")
def test_heal_replaces_a_killed_rank_with_a_hot_spare_and_ends_with_the_uninterrupted_model():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "heal.py"), "--backend", "pycoll",
                           "--scenario", "spare", "--steps", "6", "--kill-step", "2", "--json"],
                          capture_output=True, text=True, timeout=220, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)
    assert row["joined_sum_ok"] and row["max_diff_vs_uninterrupted"] == 0.0, row
    assert len(row["know_ms"]) == 3 and row["first_full_step_ms"] > 0, row
