"""Alpha-beta-gamma cost models of the TCP algorithms next to what the benchmark measures.

    python tools/model_check.py [--world-sizes 2,4] [--iters 7] [--json F] [--markdown F]

One function per algorithm gives its cost as counts (rounds, bytes moved and bytes reduced
on the critical path), T = rounds*alpha + bytes*beta + reduced*gamma; the formulas are the
table's in docs/algorithms.md, and tests/test_model_check.py checks them against the real
``Schedule`` objects. n is the docs' n: one rank's block for all_gather (bench size / P),
the bench size otherwise. The parameters are measured in the same run on the same path
(PYCOLL_TRANSPORT=tcp): alpha = the bench's ``sendrecv`` at 8 B (half a ping-pong round
trip) at the first world size, beta = its slope up to the largest size, gamma = seconds per
byte of an in-process float32 ``add_`` of 16 MiB (one thread, as the bench ranks). Then
tools/bench.py runs every algorithm with PYCOLL_ALGO forcing it (run i forces the i-th
algorithm of every collective). Measured = the bench's median over iterations of the mean
over ranks; on a shared, oversubscribed machine read ratios, not digits. Prints one table
per collective; --json writes everything, --markdown the tables (docs/algorithms.md).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the `tools` package importable
    sys.path.insert(0, str(REPO))

from tools import bench_ref  # noqa: E402
from tools.bench import parse_size  # noqa: E402

# alpha: messages (rounds) on the critical path; beta: bytes moved along it; gamma: bytes reduced
Cost = namedtuple("Cost", "alpha beta gamma")
ZERO = Cost(0, 0, 0)


def clog2(p: int) -> int:
    return (p - 1).bit_length()


def _fold(p_world: int) -> tuple[int, int, int]:
    """(p, 1 if the MPICH fold runs else 0, log2 p) for power-of-two algorithms on any world."""
    p = 1 << (p_world.bit_length() - 1)
    return p, int(p != p_world), clog2(p)


# --- one function per algorithm: (P, n bytes) -> Cost; formulas of docs/algorithms.md ---------

def ar_ring(P, n):  # 2(P-1)α + 2n(P-1)/P β + n(P-1)/P γ
    return ZERO if P < 2 else Cost(2 * (P - 1), 2 * n * (P - 1) / P, n * (P - 1) / P)


def ar_halving_doubling(P, n):  # 2 log2 p α + 2n(p-1)/p β + n(p-1)/p γ (+ 2(α+nβ) + nγ fold)
    p, f, k = _fold(P)
    return Cost(2 * k + 2 * f, 2 * n * (p - 1) / p + 2 * f * n, n * (p - 1) / p + f * n)


def ar_recursive_doubling(P, n):  # log2 p (α + nβ + nγ) (+ 2(α+nβ) + nγ fold)
    p, f, k = _fold(P)
    return Cost(k + 2 * f, k * n + 2 * f * n, k * n + f * n)


def ar_tree(P, n):  # 2⌈log2 P⌉(α + nβ) + ⌈log2 P⌉ nγ
    c = clog2(P)
    return Cost(2 * c, 2 * c * n, c * n)


def bc_binomial(P, n):  # ⌈log2 P⌉(α + nβ)
    c = clog2(P)
    return Cost(c, c * n, 0)


def bc_scatter_allgather(P, n):  # (⌈log2 P⌉ + P-1)α + 2n(P-1)/P β
    return ZERO if P < 2 else Cost(clog2(P) + P - 1, 2 * n * (P - 1) / P, 0)


def ag_ring(P, n):  # (P-1)(α + nβ), n = one rank's block
    return Cost(P - 1, n * (P - 1), 0)


def ag_bruck(P, n):  # ⌈log2 P⌉α + n(P-1)β (+ local rotation, not counted)
    return Cost(clog2(P), n * (P - 1), 0)


def ag_recursive_doubling(P, n):  # log2 P α + n(P-1)β (Bruck's schedule when P is not 2^k)
    return Cost(clog2(P), n * (P - 1), 0)


def rs_ring(P, n):  # (P-1)α + n(P-1)/P (β + γ)
    return Cost(P - 1, n * (P - 1) / P, n * (P - 1) / P)


def rs_pairwise(P, n):  # (P-1)α + n(P-1)/P (β + γ)
    return Cost(P - 1, n * (P - 1) / P, n * (P - 1) / P)


def a2a_pairwise(P, n):  # (P-1)α + n(P-1)/P β, n = one rank's whole input
    return Cost(P - 1, n * (P - 1) / P, 0)


def barrier_dissemination(P, n=0):  # ⌈log2 P⌉α
    return Cost(clog2(P), 0, 0)


MODELS = {
    "all_reduce": {"ring": ar_ring, "recursive_doubling": ar_recursive_doubling,
                   "halving_doubling": ar_halving_doubling, "tree": ar_tree},
    "all_gather": {"ring": ag_ring, "bruck": ag_bruck, "recursive_doubling": ag_recursive_doubling},
    "broadcast": {"binomial": bc_binomial, "scatter_allgather": bc_scatter_allgather},
    "reduce_scatter": {"ring": rs_ring, "pairwise": rs_pairwise},
    "all_to_all": {"pairwise": a2a_pairwise},
    "barrier": {"dissemination": barrier_dissemination},
}


def model_n(collective: str, size: int, world: int) -> float:
    """The docs' n for a bench size: all_gather's n is one rank's block, the bench's the output."""
    return size / world if collective == "all_gather" else size


def predict_us(cost: Cost, params: dict) -> float:
    return 1e6 * sum(c * params[k] for k, c in cost._asdict().items())


def plans() -> list[dict[str, str]]:
    """Bench run i forces the i-th algorithm of every collective that has one."""
    return [{c: list(a)[i] for c, a in MODELS.items() if i < len(a)}
            for i in range(max(len(a) for a in MODELS.values()))]


def measure_gamma(nbytes: int = 16 << 20, reps: int = 15) -> float:
    """Seconds per byte of a local float32 ``add_`` (median of ``reps``), one thread."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    times = [(time.perf_counter(), a.add_(b), time.perf_counter()) for _ in range(reps + 2)]
    return sorted(t1 - t0 for t0, _, t1 in times[2:])[reps // 2] / nbytes


def run_bench(world: int, algos: dict, args, extra: list[str]) -> dict:
    """One tools/bench.py run on the TCP path with PYCOLL_ALGO forcing ``algos``: its JSON."""
    env = dict(os.environ, PYCOLL_TRANSPORT="tcp",
               PYCOLL_ALGO=",".join(f"{c}={a}" for c, a in algos.items()))
    with tempfile.TemporaryDirectory(prefix="pycoll-mc-") as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, str(REPO / "tools" / "bench.py"), "--backends", "pycoll",
               "--world-size", str(world), "-c", ",".join(list(algos) + extra),
               "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
               "-f", str(args.step_factor), "--iters", str(args.iters), "--warmup",
               str(args.warmup), "--mpi", "off", "--ref-seconds", "0", "--no-progress",
               "--timeout", "60", "--deadline", "240", "--json", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if os.path.exists(out):
            return json.load(open(out))
    sys.exit(f"model_check: bench failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def times_us(doc: dict, collective: str) -> dict[int, float | None]:
    """size -> median time (us) of pycoll, None where it errored."""
    return {r["size"]: (r["results"].get("pycoll") or {}).get("time_us")
            for r in doc["collectives"][collective]["rows"]}


def fit_params(pingpong: dict[int, float], gamma: float) -> dict:
    small, big = min(pingpong), max(pingpong)
    beta = (pingpong[big] - pingpong[small]) * 1e-6 / (big - small)
    return {"alpha": pingpong[small] * 1e-6, "beta": beta, "gamma": gamma,
            "from_sizes": [small, big]}


def compare(measured: dict, params: dict, worlds: list[int]) -> dict:
    """{collective: [{size, algorithm, world, predicted_us, measured_us, ratio}]}"""
    out = {c: [] for c in MODELS}
    for (coll, algos), world in itertools.product(MODELS.items(), worlds):
        for algo, fn in algos.items():
            for size, t in measured[coll][algo][str(world)].items():
                pred = predict_us(fn(world, model_n(coll, int(size), world)), params)
                out[coll].append({"size": int(size), "algorithm": algo, "world": world,
                                  "predicted_us": pred, "measured_us": t,
                                  "ratio": t / pred if t and pred else None})
    return out


def _us(v, ratio=False):
    fmt = ".2f" if ratio else (".0f" if v is not None and v >= 100 else ".1f")
    return ("-" if ratio else "error") if v is None else format(v, fmt)


def _table_rows(rows: list[dict], worlds: list[int]):
    """One line per (size, algorithm); per world: predicted, measured, ratio."""
    by = {(r["size"], r["algorithm"], r["world"]): r for r in rows}
    keys = sorted({(r["size"], r["algorithm"]) for r in rows},
                  key=lambda k: (k[0], [r["algorithm"] for r in rows].index(k[1])))
    for size, algo in keys:
        rs = [by.get((size, algo, w)) for w in worlds]
        yield size, algo, [x for r in rs for x in ([_us(r["predicted_us"]), _us(
            r["measured_us"]), _us(r["ratio"], True)] if r else ["", "", ""])]


def format_text(result: dict) -> str:
    worlds, lines = result["meta"]["worlds"], []
    for coll, rows in result["comparison"].items():
        head = "".join(f"{'P=%d pred' % w:>12}{'meas':>10}{'ratio':>7}" for w in worlds)
        lines += ["", f"# {coll} (us; ratio = measured / predicted)",
                  f"{'size(B)':>10}  {'algorithm':<20}{head}"]
        for size, algo, cells in _table_rows(rows, worlds):
            line = "".join(f"{c:>{w}}" for c, w in zip(cells, [12, 10, 7] * len(worlds)))
            lines.append(f"{size:>10}  {algo:<20}{line}")
    return "\n".join(lines)


def summary(result: dict) -> list[str]:
    """The parameters line, the reference figures and the notes."""
    p, meta = result["params"], result["meta"]
    ref = ", ".join(f"{k[:-5]} {v:.2f}" for k, v in result["reference_GBps"].items()
                    if k.endswith("_GBps"))
    return [f"alpha = {p['alpha'] * 1e6:.0f} us, beta = {p['beta'] * 1e9:.3f} ns/B "
            f"({1e-9 / p['beta']:.2f} GB/s), gamma = {p['gamma'] * 1e9:.3f} ns/B "
            f"({1e-9 / p['gamma']:.2f} GB/s); {meta['date']}, {meta['seconds']} s, "
            f"`{meta['command']}`", f"reference (GB/s, tools/bench_ref.py): {ref}"] + meta["notes"]


def format_markdown(result: dict) -> str:
    worlds, (first, *rest) = result["meta"]["worlds"], summary(result)
    out = [first + ".", ""] + [f"- {n}" for n in rest]
    for coll, rows in result["comparison"].items():
        head = " | ".join(f"P={w} pred | P={w} meas | P={w} ratio" for w in worlds)
        out += ["", f"**{coll}** (us)", "", f"| size (B) | algorithm | {head} |",
                "|---:|---|" + "---:|" * (3 * len(worlds))]
        for size, algo, cells in _table_rows(rows, worlds):
            out.append(f"| {size} | {algo} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="model_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    for flag, kind, default in (("--min-bytes", parse_size, 8), ("--max-bytes", parse_size,
                                16 << 20), ("--step-factor", int, 8), ("--iters", int, 7),
                                ("--warmup", int, 2)):
        ap.add_argument(flag, type=kind, default=default)
    ap.add_argument("--json", help="write parameters, measurements and predictions here")
    ap.add_argument("--markdown", help="write the tables as markdown here")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    t_start = time.monotonic()
    reference = bench_ref.measure(0.5)  # raw loopback TCP one way / both ways, memcpy (GB/s)
    gamma = measure_gamma()
    measured = {c: {a: {} for a in algos} for c, algos in MODELS.items()}
    pingpong = {}
    for world in worlds:
        for i, algos in enumerate(plans()):
            print(f"[model_check] world {world}: {algos} ({time.monotonic() - t_start:.0f}s)",
                  file=sys.stderr, flush=True)
            doc = run_bench(world, algos, args, ["sendrecv"] if i == 0 else [])
            if i == 0:
                pingpong[str(world)] = times_us(doc, "sendrecv")
            for coll, algo in algos.items():
                measured[coll][algo][str(world)] = times_us(doc, coll)
    pp0 = {s: t for s, t in pingpong[str(worlds[0])].items() if t is not None}
    params = fit_params(pp0, gamma)
    cpus = os.cpu_count() or 1
    notes = [f"parameters from world {worlds[0]} sendrecv (one pair) and a local add_",
             "times: medians over iterations of the mean over ranks; shared machine: noisy"]
    if max(pp0) < args.max_bytes:
        notes.append(f"sendrecv failed above {max(pp0)} B: beta is fitted up to {max(pp0)} B")
    notes += [f"world {w} is oversubscribed: {w} rank processes on {cpus} CPUs"
              for w in worlds if w > cpus]
    result = {
        "meta": {"worlds": worlds, "iters": args.iters, "warmup": args.warmup, "cpus": cpus,
                 "date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "command": "python tools/model_check.py " + " ".join(argv or sys.argv[1:]),
                 "host": os.uname().nodename, "seconds": round(time.monotonic() - t_start),
                 "notes": notes},
        "params": params, "sendrecv_us": pingpong, "reference_GBps": reference,
        "params_by_world": {w: fit_params({s: t for s, t in pp.items() if t is not None}, gamma)
                            for w, pp in pingpong.items()},
        "comparison": compare(measured, params, worlds),
    }
    print("\n".join("# " + line for line in summary(result)))
    print(format_text(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
