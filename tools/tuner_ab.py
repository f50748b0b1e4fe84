"""Before/after sweep of a tuner change: two checkouts' benchmarks alternated, A B A B.

    python tools/tuner_ab.py --before DIR --after DIR [--world-size 2] [--transport tcp]
                             [--pairs 3] [--iters 20] [--json F] [--markdown F]

Each run is ``python -m pycoll bench --backends pycoll,gloo -c all_reduce`` from 8 B to 64 MiB
(factor 2), started in the checkout with ``PYTHONPATH`` pointing at it, so that it imports that
checkout's pycoll (benchmark harness included: make both from the same commit so that only the
change under test differs). ``--transport`` sets ``PYCOLL_TRANSPORT`` (``default``: leave it
unset, the shared-memory path on one host). Runs alternate before, after, before, after ...
``--pairs`` times, so that the phases of a shared machine land on both. Per size the table gives
each side's pycoll time, median over runs and best run, after/before of both (below 1: the
change is faster), gloo's median (both sides' runs), each side's speed ratio gloo/pycoll from
the medians as the bench prints it (above 1: pycoll is faster), and the all_reduce algorithm
each side's tuner picks. The best run is there because whole runs of the same code land in a
fast or a slow mode on this machine (pycoll over TCP at world 2: ~2x apart at every size),
which the medians of a few runs mix by chance. ``--render F`` prints a saved --json again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHOICES = """
import json, os, sys
from pycoll.core.tuner import Tuner
w, sizes, tcp = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3] == "tcp"
cores = len(os.sched_getaffinity(0))
try:   # as the group would: crowded when all its ranks run TCP rounds on fewer cores
    t = Tuner(w, cores=cores if tcp and w > cores else None)
except TypeError:   # a tree from before the tuner knew crowded hosts
    t = Tuner(w)
print(json.dumps([t.choose("all_reduce", n, w) for n in sizes]))
"""


def bench(tree: Path, args, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("PYCOLL_ALGO", None)
    env.pop("PYCOLL_COST", None)
    if args.transport == "default":
        env.pop("PYCOLL_TRANSPORT", None)
    else:
        env["PYCOLL_TRANSPORT"] = args.transport
    cmd = [sys.executable, "-m", "pycoll", "bench", "--backends", "pycoll,gloo",
           "--world-size", str(args.world_size), "-c", "all_reduce", "--min-bytes", "8",
           "--max-bytes", args.max_bytes, "-f", "2", "--iters", str(args.iters), "--warmup",
           str(args.warmup), "--mpi", "off", "--ref-seconds", "0", "--no-progress",
           "--timeout", "120", "--deadline", "600", "--json", out]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if not os.path.exists(out):
        sys.exit(f"tuner_ab: bench in {tree} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def times(doc: dict, backend: str) -> dict[int, float]:
    rows = doc["collectives"]["all_reduce"]["rows"]
    return {r["size"]: r["results"][backend]["time_us"] for r in rows
            if (r["results"].get(backend) or {}).get("time_us")}


def choices(tree: Path, world: int, sizes: list[int], transport: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("PYCOLL_ALGO", None)
    env.pop("PYCOLL_COST", None)
    out = subprocess.run([sys.executable, "-c", CHOICES, str(world), json.dumps(sizes), transport], env=env,
                         cwd=tree, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def summarise(runs: dict, algo: dict) -> list[dict]:
    """Per size: medians and best runs of both sides, gloo's median, ratios, algorithms."""
    sizes = sorted(set.intersection(*(set(r["pycoll"]) for side in runs.values() for r in side)),
                   key=int)
    rows = []
    for n in sizes:
        t = {side: [r["pycoll"][n] for r in runs[side]] for side in runs}
        med = {side: statistics.median(v) for side, v in t.items()}
        best = {side: min(v) for side, v in t.items()}
        gloo = statistics.median(r["gloo"][n] for side in runs.values() for r in side if n in r["gloo"])
        rows.append({"size": int(n), "before_us": med["before"], "after_us": med["after"],
                     "after_over_before": med["after"] / med["before"],
                     "best_before_us": best["before"], "best_after_us": best["after"],
                     "best_after_over_before": best["after"] / best["before"], "gloo_us": gloo,
                     "speedup_before": gloo / med["before"], "speedup_after": gloo / med["after"],
                     "algo_before": algo["before"][str(n)], "algo_after": algo["after"][str(n)]})
    return rows


def table(result: dict) -> list[str]:
    head = ("| size (B) | before (us) | after (us) | after/before | best before | best after | "
            "best after/before | gloo (us) | gloo/pycoll before | gloo/pycoll after | "
            "algorithm before | algorithm after |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['size']} | {r['before_us']:.1f} | {r['after_us']:.1f} | "
                     f"{r['after_over_before']:.2f} | {r['best_before_us']:.1f} | "
                     f"{r['best_after_us']:.1f} | {r['best_after_over_before']:.2f} | "
                     f"{r['gloo_us']:.1f} | {r['speedup_before']:.2f} | {r['speedup_after']:.2f} | "
                     f"{r['algo_before']} | {r['algo_after']} |")
    return lines


def title(result: dict) -> str:
    return (f"# all_reduce world {result['world']}, PYCOLL_TRANSPORT={result['transport']}, "
            f"{result['pairs']} pairs A B, {result['seconds']} s, {result['date']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tuner_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="checkout with the old code")
    ap.add_argument("--after", type=Path, help="checkout with the new code")
    ap.add_argument("--world-size", "-n", type=int, default=2)
    ap.add_argument("--transport", default="tcp", help="PYCOLL_TRANSPORT, or 'default' (unset)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--render", help="print the tables of a saved --json and exit")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        print(title(result))
        print("\n".join(table(result)))
        return 0
    if args.before is None or args.after is None:
        ap.error("--before and --after are required (or --render)")
    t0, docs = time.monotonic(), {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="pycoll-ab-") as tmp:
        for i in range(args.pairs):
            for side in ("before", "after"):
                print(f"[tuner_ab] pair {i + 1}/{args.pairs}: {side} "
                      f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
                docs[side].append(bench(getattr(args, side), args, os.path.join(tmp, f"{side}{i}.json")))
    runs = {side: [{"pycoll": {str(k): v for k, v in times(d, "pycoll").items()},
                    "gloo": {str(k): v for k, v in times(d, "gloo").items()}} for d in ds]
            for side, ds in docs.items()}
    sizes = sorted({int(n) for side in runs.values() for r in side for n in r["pycoll"]})
    algo = {side: {str(n): a for n, a in zip(sizes, choices(getattr(args, side), args.world_size, sizes,
                                                                     args.transport.lower()))}
            for side in runs}
    result = {"world": args.world_size, "transport": args.transport, "pairs": args.pairs,
              "iters": args.iters, "seconds": round(time.monotonic() - t0),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
              "algorithms": algo, "runs_us": runs, "rows": summarise(runs, algo)}
    print(title(result))
    print("\n".join(table(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(title(result) + "\n\n" + "\n".join(table(result)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
