"""Every algorithm of one collective, interleaved in the same processes, against the tuner.

    python tools/algo_sweep.py [--collective all_reduce] [--world-sizes 2,3,4] [-b 8]
                               [-e 64M] [-f 2] [--rounds 4] [--iters 4] [--repeat 1]
                               [--fit] [--json F]

tools/model_check.py forces one algorithm per benchmark run, so two algorithms are measured
minutes apart, in different phases of a shared machine, and their order at one size can flip
from run to run. Here the ranks (on the TCP path, as the tuner's schedules run there) switch
algorithms with ``pycoll.set_algorithm`` inside one process group: per size, ``--rounds``
rounds of ``--iters`` timed ops of each algorithm in turn, A B C A B C ..., so that noise
lands on all of them alike; ``--repeat N`` runs the whole sweep N times (fresh processes)
and keeps each cell's geometric mean of the N medians. An op's time is the mean over ranks (as python -m pycoll bench); the table
gives medians, the measured fastest algorithm, and the one the tuner (this checkout's
``DEFAULT_PARAMS``, or ``PYCOLL_COST``) chooses, with its time over the fastest one's.
``--fit`` also fits alpha, beta and delta to the times of every world size swept at once
(tools/model_check.py's ``fit_collectives``: an intercept per world for the op's fixed cost,
gamma from a local add_) and prints the PYCOLL_COST value and the table the tuner would use
with it; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the `tools` package importable
    sys.path.insert(0, str(REPO))

import torch
import torch.distributed as dist

from pycoll import algorithms
from pycoll.algorithms.cost import Params
from pycoll.cli.bench.launch import parse_size


def _tensors(collective: str, nbytes: int, world: int):
    """(call, one op's bytes as the communicator sees them) for a float32 message."""
    n = max(1, nbytes // 4)
    if collective == "all_reduce":
        t = torch.zeros(n)
        return (lambda g: dist.all_reduce(t, group=g)), t.nbytes
    if collective == "broadcast":
        t = torch.zeros(n)
        return (lambda g: dist.broadcast(t, 0, group=g)), t.nbytes
    if collective == "all_gather":
        blk = max(1, n // world)
        inp, out = torch.zeros(blk), torch.zeros(blk * world)
        return (lambda g: dist.all_gather_into_tensor(out, inp, group=g)), out.nbytes
    if collective == "reduce_scatter":
        blk = max(1, n // world)
        inp, out = torch.zeros(blk * world), torch.zeros(blk)
        return (lambda g: dist.reduce_scatter_tensor(out, inp, group=g)), inp.nbytes
    raise SystemExit(f"algo_sweep: --collective {collective!r}: choose all_reduce, broadcast, "
                     "all_gather or reduce_scatter")


def _rank(rank: int, world: int, port: int, cfg: dict) -> dict | None:
    import pycoll

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    group = dist.new_group(backend="pycoll", timeout=timedelta(seconds=120))
    coll, algos = cfg["collective"], cfg["algorithms"]
    times: dict[str, dict[int, list[float]]] = {a: {} for a in algos}
    for size in cfg["sizes"]:
        op, nbytes = _tensors(coll, size, world)
        for a in algos:
            pycoll.set_algorithm(coll, a, group=group)
            for _ in range(cfg["warmup"]):
                op(group)
        for _ in range(cfg["rounds"]):
            for a in algos:
                pycoll.set_algorithm(coll, a, group=group)
                dist.barrier()  # gloo, untimed: every rank starts the batch together
                for _ in range(cfg["iters"]):
                    t0 = time.perf_counter()
                    op(group)
                    times[a].setdefault(nbytes, []).append(time.perf_counter() - t0)
    mine = torch.tensor([t for a in algos for n in sorted(times[a]) for t in times[a][n]],
                        dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    doc = None
    if rank == 0:
        mean = torch.stack(everyone).mean(0).tolist()  # per op: the mean over ranks
        doc, i = {}, 0
        for a in algos:
            doc[a] = {}
            for n in sorted(times[a]):
                k = len(times[a][n])
                doc[a][n] = statistics.median(mean[i:i + k]) * 1e6
                i += k
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return doc


def sweep(collective: str, world: int, sizes: list[int], rounds: int, iters: int,
          warmup: int) -> dict[str, dict[int, float]]:
    """{algorithm: {bytes: median us}} measured on the TCP path."""
    from pycoll.testing import spawn

    cfg = {"collective": collective, "algorithms": list(algorithms.ALGORITHMS[collective]),
           "sizes": sizes, "rounds": rounds, "iters": iters, "warmup": warmup}
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYCOLL_TRANSPORT": "tcp"}
    saved = os.environ.pop("PYCOLL_ALGO", None)   # set_algorithm decides, per group
    try:
        doc = spawn.run(_rank, world, cfg, env=env, store_timeout=60)[0]
    finally:
        if saved is not None:
            os.environ["PYCOLL_ALGO"] = saved
    return {a: {int(n): t for n, t in by.items()} for a, by in doc.items()}


def pool(runs: list[dict]) -> dict:
    """Cell by cell, the geometric mean of several sweeps' medians."""
    return {a: {n: math.exp(sum(math.log(r[a][n]) for r in runs) / len(runs)) for n in runs[0][a]}
            for a in runs[0]}


def report(collective: str, world: int, measured: dict, tuner, label: str = "") -> list[str]:
    algos = list(measured)
    sizes = sorted(next(iter(measured.values())))
    title = (f"# {collective} world {world}, TCP: median us per op (mean over ranks); fastest = "
             f"measured, tuner = computed choice{' ' + label if label else ''}, tuner/fastest = "
             "its time over the fastest's")
    lines = [title,
             f"{'bytes':>10}" + "".join(f"{a:>20}" for a in algos)
             + f"{'fastest':>20}{'tuner':>20}{'tuner/fastest':>15}"]
    for n in sizes:
        row = {a: measured[a][n] for a in algos}
        best = min(row, key=row.get)
        pick = tuner.choose(collective, n, world)
        lines.append(f"{n:>10}" + "".join(f"{row[a]:>20.1f}" for a in algos)
                     + f"{best:>20}{pick:>20}{row[pick] / row[best]:>15.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="algo_sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collective", "-c", default="all_reduce")
    ap.add_argument("--world-sizes", "-n", default="2", help="comma-separated, e.g. 2,3,4")
    ap.add_argument("--min-bytes", "-b", type=parse_size, default=8)
    ap.add_argument("--max-bytes", "-e", type=parse_size, default=64 << 20)
    ap.add_argument("--step-factor", "-f", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="whole sweeps, pooled (geometric mean)")
    ap.add_argument("--fit", action="store_true", help="fit alpha and beta to these times")
    ap.add_argument("--json", help="write the times (and the fit) here")
    args = ap.parse_args(argv)
    from pycoll.core.tuner import Tuner
    from tools import model_check

    worlds = [int(w) for w in args.world_sizes.split(",")]
    sizes, n = [], args.min_bytes
    while n <= args.max_bytes:
        sizes.append(n)
        n *= args.step_factor
    t0 = time.monotonic()
    measured = {w: pool([sweep(args.collective, w, sizes, args.rounds, args.iters, args.warmup)
                         for _ in range(args.repeat)]) for w in worlds}
    doc = {"collective": args.collective, "worlds": worlds,
           "times_us": {str(w): m for w, m in measured.items()},
           "seconds": round(time.monotonic() - t0), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv)}
    tuner = Tuner(worlds[0])
    print(f"# tuner parameters ({tuner.source}): {tuner.params}; {doc['seconds']} s")
    for w in worlds:
        print("\n".join(report(args.collective, w, measured[w], tuner)))
    if args.fit:
        gamma, _ = model_check.measure_local()
        by_world = {args.collective: {a: {str(w): {str(n): t for n, t in measured[w][a].items()}
                                          for w in worlds} for a in measured[worlds[0]]}}
        fit = model_check.fit_collectives(by_world, worlds, gamma)
        doc["fit"], doc["PYCOLL_COST"] = fit, model_check.cost_env(fit)
        print(f"# fit: {fit['from']}; intercepts (us): {fit['intercept_us']}")
        print(f"# PYCOLL_COST={doc['PYCOLL_COST']}")
        fitted = Tuner(worlds[0], params=Params(**{k: fit[k] for k in ("alpha", "beta", "gamma", "delta")}))
        for w in worlds:
            print("\n".join(report(args.collective, w, measured[w], fitted, "with the fit")))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
