"""``python -m pycoll demo``: local ranks run every collective and train a model, pycoll vs gloo.

The main job of the README: it shows a newcomer, in under half a minute, that the backend
works on this machine and what it is worth. The ranks open a pycoll default group and a gloo
group; every collective runs on both, each rank checks every result against the value it
must have and against gloo's, and the two are timed in interleaved rounds
(``demo_checks``). Then torch's DistributedDataParallel trains the same small MLP on a
generated task on each backend, blocks of steps alternating (``demo_task``): steps/s, final
accuracy, and whether the two final models agree. The exit status is non-zero if any check
fails: a wrong or differing collective result, parameters that differ between ranks, final
models that disagree, or a test accuracy under ``demo_task.THRESHOLD``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

BACKENDS = ("pycoll", "gloo")


def _rank_main(rank: int, world: int, port: int, steps: int, rounds: int) -> tuple:
    import torch
    import torch.distributed as dist

    import pycoll  # noqa: F401  registers the backend
    from pycoll.cli.demo_checks import check_all, time_all
    from pycoll.cli.demo_task import train

    # the cores are shared, as torchrun assumes
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("pycoll", rank=rank, world_size=world, store=store, timeout=timeout)
    groups = {"pycoll": dist.group.WORLD, "gloo": dist.new_group(backend="gloo", timeout=timeout)}
    rows = check_all(rank, world, groups)
    time_all(rank, world, groups, rows, rounds)
    ddp = train(rank, world, groups, steps)
    dist.destroy_process_group()
    return rows, ddp


def _run_ranks(world: int, steps: int, rounds: int) -> dict | None:
    from pycoll.testing import spawn

    # Generous for this machine's 400 steps and 7 rounds (about 5 s), and growing with them.
    timeout = 120 + 0.2 * steps * world + 10 * rounds
    try:
        return dict(enumerate(spawn.run(_rank_main, world, steps, rounds, timeout=timeout)))
    except spawn.RankFailed as exc:
        print(f"a rank failed or timed out: {exc}", file=sys.stderr)
        return None


def _size(n: int) -> str:
    if n == 0:
        return "-"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _median_slowest(per_rank: list[list[float]]) -> float:
    """Median over rounds (or blocks) of the slowest rank's value in each."""
    return statistics.median(max(vals) for vals in zip(*per_rank))


def report_collectives(results: dict, rounds: int) -> int:
    """Prints the collectives' table from every rank's rows; returns how many failed a check."""
    print(f"{'collective':29} {'bytes':>8} {'pycoll us':>10} {'gloo us':>10} {'speed-up':>9}"
          "  correct  same as gloo")
    failed = 0
    for i, row in enumerate(results[0][0]):
        rows = [results[r][0][i] for r in results]
        bad = [b for b in BACKENDS if not all(x["ok"][b] for x in rows)]
        same = all(x["same"] for x in rows)
        us = {b: _median_slowest([x["us"][b] for x in rows]) for b in BACKENDS}
        failed += bool(bad) or not same
        print(f"{row['name']:29} {_size(row['bytes']):>8} {us['pycoll']:10.1f} {us['gloo']:10.1f}"
              f" {us['gloo'] / us['pycoll']:8.2f}x  {'NO: ' + ','.join(bad) if bad else 'yes':7}"
              f"  {'yes' if same else 'NO'}")
    print(f"(us per call: median of {rounds} interleaved rounds, slowest rank; "
          "speed-up = gloo us / pycoll us)")
    return failed


def _curve(points: list, steps: int) -> str:
    marks = sorted({min(points, key=lambda p: abs(p[0] - steps * k / 4))[0] for k in range(5)})
    acc = dict(points)
    return ", ".join(f"step {s} {acc[s]:.1%}" for s in marks)


def report_training(results: dict, steps: int) -> list[str]:
    """Prints the DDP section from every rank's results; returns the failed checks, in words."""
    from pycoll.cli import demo_task as task

    ddp = results[0][1]
    print(f"\ntorch DDP on each backend\ntask:  {task.TASK}\nmodel: {task.MODEL}\n"
          f"train: {steps} steps of {task.BATCH_PER_RANK} x {len(results)} points, the backends "
          f"alternating in blocks of {task.BLOCK} steps")
    print(f"{'backend':8} {'steps/s':>8}  {'train loss first -> last':>24}  {'train acc':>9}  "
          f"{'test acc':>8}")
    rate = {}
    for b in BACKENDS:
        per_rank = [[sec for _, sec in results[r][1][b]["blocks"]] for r in results]
        n = [k for k, _ in ddp[b]["blocks"]]
        rate[b] = statistics.median(k / max(secs) for k, secs in zip(n, zip(*per_rank)))
        first, last = ddp[b]["loss"]
        print(f"{b:8} {rate[b]:8.1f}  {first:13.3f} -> {last:<7.3f}  {ddp[b]['train_acc']:9.1%}  "
              f"{ddp[b]['test_acc']:8.1%}")
    print(f"(steps/s: median over blocks, slowest rank; speed-up pycoll / gloo "
          f"{rate['pycoll'] / rate['gloo']:.2f}x)")
    print(f"test accuracy while training (pycoll): {_curve(ddp['pycoll']['curve'], steps)}")
    failed = []
    diff = max(results[r][1]["max_param_diff"] for r in results)
    agree = diff <= task.AGREE_TOL
    print("pycoll and gloo final models: " + (
        "identical (bitwise)" if diff == 0 else
        f"{'agree' if agree else 'DIFFER'}: max |parameter difference| {diff:.1e} (tolerance "
        f"{task.AGREE_TOL:.0e}), same test predictions {ddp['same_predictions']:.1%}"))
    if not agree:
        failed.append("the pycoll and gloo models differ")
    same = all(results[r][1][b]["identical_on_ranks"] for r in results for b in BACKENDS)
    print(f"parameters identical on all ranks: {'yes' if same else 'NO'} (both backends)")
    if not same:
        failed.append("parameters differ between ranks")
    worst = min(ddp[b]["test_acc"] for b in BACKENDS)
    if steps < task.MIN_STEPS:
        print(f"learning check skipped: --steps {steps} < {task.MIN_STEPS}")
    elif worst < task.THRESHOLD:
        failed.append(f"test accuracy {worst:.1%} < {task.THRESHOLD:.0%}: the model did not learn")
    else:
        print(f"learned: test accuracy {worst:.1%} >= {task.THRESHOLD:.0%} on both backends "
              f"(chance {task.CHANCE:.0%}, a linear model {task.LINEAR:.0%})")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pycoll demo", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", "-n", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400, help="DDP training steps per backend")
    ap.add_argument("--rounds", type=int, default=7,
                    help="interleaved timing rounds of the collectives")
    args = ap.parse_args(argv)
    if min(args.world_size, args.steps, args.rounds) < 1:
        ap.error("--world-size, --steps and --rounds must be at least 1")
    from pycoll.cli.demo_task import MIN_STEPS

    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    results = _run_ranks(args.world_size, args.steps, args.rounds)
    if results is None:
        return 1
    world = args.world_size
    # The figures depend on what else runs (pycoll's waits adapt to it): say what did.
    print(f"pycoll demo: {world} rank{'s' * (world != 1)} on this machine ({os.cpu_count()} "
          f"cores, load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)\n"
          "every collective on pycoll and on gloo, same inputs, checked and timed\n")
    failed_rows = report_collectives(results, args.rounds)
    failed = [f"{failed_rows} collective(s) wrong or unlike gloo"] if failed_rows else []
    failed += report_training(results, args.steps)
    n = len(results[0][0])
    verdict = "FAILED: " + "; ".join(failed) if failed else "all passed"
    if args.steps < MIN_STEPS:
        verdict += " (learning not checked)"
    print(f"\nchecks: {verdict} ({n - failed_rows}/{n} collectives correct on both backends "
          "and equal to gloo)")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0
