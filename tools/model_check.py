"""Alpha-beta-gamma cost models of the TCP algorithms next to what the benchmark measures,
and the fit of the tuner's parameters.

    python tools/model_check.py [--world-sizes 2,4] [--iters 7] [--collectives all_reduce]
                                [--fit] [--json F] [--markdown F]

The models are the package's: each algorithm module's ``terms(world, n)`` (rounds, bytes
moved and bytes reduced on the critical path; the table in docs/algorithms.md, checked
against the real ``Schedule`` objects by tests/clients/test_model_check.py) and ``copied(world, n)``
(bytes copied locally), priced by its ``cost(world, nbytes, params)`` as the tuner prices
them: T = rounds*alpha + bytes*beta + reduced*gamma + copied*delta. The parameters are
measured in the same run on the same path (PYCOLL_TRANSPORT=tcp): gamma and delta = seconds
per byte of an in-process float32 ``add_`` and ``copy_`` of 16 MiB (one thread, as the bench
ranks); alpha = the bench's ``sendrecv`` at 8 B (half a ping-pong round trip) at the first
world size and beta = its slope up to the largest size. With ``--fit``, alpha, beta and delta
are fitted to the collectives themselves instead (``fit_collectives``: least squares on
relative error over every algorithm, size and world measured, with an intercept per world
for the op's fixed cost; gamma stays the local figure). tools/algo_sweep.py makes the same
fit from interleaved measurements, which is how the tuner's ``DEFAULT_PARAMS`` were found;
the PYCOLL_COST line printed sets them for a group. Then python -m pycoll bench runs every
algorithm with PYCOLL_ALGO forcing it (run i forces the i-th algorithm of every collective).
Measured = the bench's median over iterations of the mean over ranks; on a shared,
oversubscribed machine read ratios, not digits. Prints one table per collective; --json
writes everything, --markdown the tables.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the `tools` package importable
    sys.path.insert(0, str(REPO))

from pycoll import algorithms  # noqa: E402
from pycoll.algorithms.cost import ZERO as TERMS_ZERO  # noqa: E402
from pycoll.algorithms.cost import Params, Terms  # noqa: E402
from pycoll.cli.bench import ref as bench_ref  # noqa: E402
from pycoll.cli.bench.launch import parse_size  # noqa: E402

# The models are the package's (pycoll/algorithms/<module>.py: terms, copied, cost), the ones
# the tuner prices; here only the collectives whose schedules the bench forces one by one.
Cost, ZERO = Terms, TERMS_ZERO
CHECKED = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all", "barrier")
MODELS = {c: {a: m.terms for a, m in algorithms.MODULES[c].items()} for c in CHECKED}
# Names tests/clients/test_model_check.py checks the fold on.
ar_ring, ar_halving_doubling, ar_recursive_doubling = (
    MODELS["all_reduce"][a] for a in ("ring", "halving_doubling", "recursive_doubling"))


def priced(params: dict) -> Params:
    return Params(**{k: params.get(k, 0.0) for k in ("alpha", "beta", "gamma", "delta")})


def predict_us(cost: Cost, params: dict) -> float:
    """The three terms of the docs' table priced (no local copies): microseconds."""
    return 1e6 * priced(params).seconds(cost)


def plans(collectives=CHECKED) -> list[dict[str, str]]:
    """Bench run i forces the i-th algorithm of every collective that has one."""
    models = [MODELS[c] for c in collectives]
    return [{c: list(a)[i] for c, a in zip(collectives, models) if i < len(a)}
            for i in range(max(len(a) for a in models))]


def measure_local(nbytes: int = 16 << 20, reps: int = 15) -> tuple[float, float]:
    """Seconds per byte of a local float32 ``add_`` (gamma) and ``copy_`` (delta), medians
    of ``reps``, one thread."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)

    def per_byte(op) -> float:
        times = [(time.perf_counter(), op(), time.perf_counter()) for _ in range(reps + 2)]
        return sorted(t1 - t0 for t0, _, t1 in times[2:])[reps // 2] / nbytes
    return per_byte(lambda: a.add_(b)), per_byte(lambda: a.copy_(b))


def run_bench(world: int, algos: dict, args, extra: list[str]) -> dict:
    """One python -m pycoll bench run on the TCP path with PYCOLL_ALGO forcing ``algos``: its JSON."""
    env = dict(os.environ, PYCOLL_TRANSPORT="tcp",
               PYCOLL_ALGO=",".join(f"{c}={a}" for c, a in algos.items()))
    with tempfile.TemporaryDirectory(prefix="pycoll-mc-") as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "pycoll", "bench", "--backends", "pycoll",
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


def fit_params(pingpong: dict[int, float], gamma: float, delta: float) -> dict:
    small, big = min(pingpong), max(pingpong)
    beta = (pingpong[big] - pingpong[small]) * 1e-6 / (big - small)
    return {"alpha": pingpong[small] * 1e-6, "beta": beta, "gamma": gamma, "delta": delta,
            "from": f"sendrecv {small}-{big} B"}


FITTED = ("alpha", "beta", "delta")


def fit_collectives(measured: dict, worlds: list[int], gamma: float) -> dict:
    """alpha, beta and delta that minimise the squared relative error of the model over
    every (collective, algorithm, size) measured at ``worlds``, gamma held at the local
    ``add_`` figure. Each world also gets an intercept: the op's fixed cost outside the
    schedule (c10d call, queue, wake-ups), the same whatever the algorithm, so it changes no
    choice and is left out of the tuner's parameters; without it alpha would absorb it and
    price every round as if it were a whole op. delta is fitted, not measured: a local copy
    in an op goes through a fresh temp (page faults) that an in-cache ``copy_`` does not
    see. A parameter the fit drives below 0 is set to 0 and the rest refitted."""
    import numpy as np
    rows, rhs = [], []
    for i, world in enumerate(worlds):
        for coll, algos in measured.items():
            for algo, by_world in algos.items():
                module = algorithms.MODULES[coll][algo]
                for size, t in by_world.get(str(world), {}).items():
                    if not t:
                        continue
                    n = int(size) / world if coll == "all_gather" else int(size)
                    terms = module.terms(world, n)
                    x = {"alpha": terms.alpha, "beta": terms.beta, "delta": module.copied(world, n)}
                    w = 1.0 / (t * 1e-6)  # relative error: a 20 ms point weighs as a 200 us one
                    rows.append([w * (j == i) for j in range(len(worlds))] + [x[k] * w for k in FITTED])
                    rhs.append((t * 1e-6 - terms.gamma * gamma) * w)
    a, b, free = np.array(rows), np.array(rhs), list(FITTED)
    fixed = {"gamma": gamma}
    while True:
        sol = np.linalg.lstsq(a, b, rcond=None)[0]
        coef = sol[len(worlds):]
        if not len(coef) or min(coef) >= 0:
            break
        k = int(np.argmin(coef))
        fixed[free.pop(k)] = 0.0
        a = np.delete(a, len(worlds) + k, axis=1)
    out = {**fixed, **{k: float(v) for k, v in zip(free, coef)}}
    out["intercept_us"] = {str(w): round(float(v) * 1e6, 1) for w, v in zip(worlds, sol)}
    out["from"] = (f"least squares over {len(rhs)} collective times at world "
                   f"{','.join(map(str, worlds))} (gamma from a local add_; the op's fixed cost, "
                   f"per world: {', '.join(f'{v:g} us' for v in out['intercept_us'].values())})")
    return out


def compare(measured: dict, params: dict, worlds: list[int]) -> dict:
    """{collective: [{size, algorithm, world, predicted_us, measured_us, ratio}]}"""
    out, p = {c: [] for c in measured}, priced(params)
    for (coll, algos), world in itertools.product(measured.items(), worlds):
        for algo in algos:
            cost = algorithms.COSTS[coll][algo]
            for size, t in measured[coll][algo][str(world)].items():
                pred = 1e6 * cost(world, int(size), p)
                out[coll].append({"size": int(size), "algorithm": algo, "world": world,
                                  "predicted_us": pred, "measured_us": t,
                                  "ratio": t / pred if t and pred else None})
    return out


def cost_env(params: dict) -> str:
    """The PYCOLL_COST value that sets these parameters for a group."""
    return ",".join(f"{k}={params[k] * (1e6 if k == 'alpha' else 1e9):.4g}"
                    f"{'us' if k == 'alpha' else 'ns'}" for k in ("alpha", "beta", "gamma", "delta"))


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
    def rate(v: float) -> str:
        return f"{1e-9 / v:.2f} GB/s" if v > 0 else "no cost"
    return [(f"alpha = {p['alpha'] * 1e6:.0f} us, beta = {p['beta'] * 1e9:.3f} ns/B "
            f"({rate(p['beta'])}), gamma = {p['gamma'] * 1e9:.3f} ns/B ({rate(p['gamma'])}), "
            f"delta = {p['delta'] * 1e9:.3f} ns/B ({rate(p['delta'])}), from {p['from']}; "
            f"{meta['date']}, {meta['seconds']} s, `{meta['command']}`"),
            f"PYCOLL_COST={cost_env(p)}",
            f"reference (GB/s, pycoll/cli/bench/ref.py): {ref}"] + meta["notes"]


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
    ap.add_argument("--collectives", default=",".join(CHECKED),
                    help=f"comma-separated subset of {','.join(CHECKED)} (default all)")
    ap.add_argument("--fit", action="store_true", help="fit alpha, beta and delta to the "
                    "collectives measured (default: alpha, beta from sendrecv)")
    ap.add_argument("--json", help="write parameters, measurements and predictions here")
    ap.add_argument("--markdown", help="write the tables as markdown here")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    colls = [c.strip() for c in args.collectives.split(",") if c.strip()]
    if not colls or set(colls) - set(CHECKED):
        ap.error(f"--collectives: choose from {', '.join(CHECKED)}")
    t_start = time.monotonic()
    reference = bench_ref.measure(0.5)  # raw loopback TCP one way / both ways, memcpy (GB/s)
    gamma, delta = measure_local()
    measured = {c: {a: {} for a in MODELS[c]} for c in colls}
    pingpong = {}
    for world in worlds:
        for i, algos in enumerate(plans(colls)):
            print(f"[model_check] world {world}: {algos} ({time.monotonic() - t_start:.0f}s)",
                  file=sys.stderr, flush=True)
            doc = run_bench(world, algos, args, ["sendrecv"] if i == 0 else [])
            if i == 0:
                pingpong[str(world)] = times_us(doc, "sendrecv")
            for coll, algo in algos.items():
                measured[coll][algo][str(world)] = times_us(doc, coll)
    pp0 = {s: t for s, t in pingpong[str(worlds[0])].items() if t is not None}
    by_pingpong = fit_params(pp0, gamma, delta)
    params = fit_collectives(measured, worlds, gamma) if args.fit else by_pingpong
    cpus = os.cpu_count() or 1
    notes = [("alpha, beta, delta fitted to the collectives (--fit), gamma from a local add_"
              if args.fit else f"alpha, beta from world {worlds[0]} sendrecv (one pair); "
              "gamma, delta from a local add_ and copy_"),
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
        "params": params, "params_sendrecv": by_pingpong, "sendrecv_us": pingpong,
        "reference_GBps": reference,
        "params_by_world": {w: fit_params({s: t for s, t in pp.items() if t is not None},
                                          gamma, delta) for w, pp in pingpong.items()},
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
