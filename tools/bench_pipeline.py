"""Pipeline-parallel training on pycoll and gloo: torch.distributed.pipelining, one invocation.

    python tools/bench_pipeline.py [--world-size 2] [--schedules gpipe,1f1b] [--hidden 256]
        [--layers 4] [--microbatches 8] [--batch 64] [--rounds 5] [--steps 10] [--warmup 3]
        [--load N] [--json out.json]

Each rank is one stage (``--layers`` Linear+ReLU layers of width ``--hidden``; the last
stage's loss is a mean square) of torch's own pipelining (``PipelineStage`` with
``ScheduleGPipe`` or ``Schedule1F1B``), whose activations and gradients move with
``batch_isend_irecv``: the point-to-point path of the group it is given. The ranks start once
(``pycoll.testing.spawn``, forkserver, torch preloaded) around a gloo default group and open a
``new_group`` per backend; the backends run interleaved (A B A B, the order rotating each
round) so a noisy phase hits both, each block ``--steps`` timed steps after ``--warmup``,
timed by the slowest rank. The report gives steps/s per (schedule, backend) as the median
over rounds, and pycoll/gloo per round. ``--load N`` runs everything beside N busy processes
(``pycoll.cli.bench.load.Busy``). Both backends train identical stages on identical data: the
final losses are printed side by side and must agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `pycoll` importable from the checkout
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

SCHEDULES = ("gpipe", "1f1b")


def _stage_module(stage: int, hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(1000 + stage)   # the same weights on every backend
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods)


def _block(schedule: str, group, rank: int, world: int, opts: dict) -> tuple[float, float]:
    """``opts['steps']`` timed training steps after warm-up: (seconds per step, last loss)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    hidden, mb, batch = opts["hidden"], opts["microbatches"], opts["batch"]
    module = _stage_module(rank, hidden, opts["layers"])
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
    loss_fn = (lambda out, target: ((out - target) ** 2).mean())
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=mb, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, hidden, generator=g)
    y = torch.randn(batch, hidden, generator=g)
    last = float("nan")

    def step() -> None:
        nonlocal last
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            losses: list = []
            sched.step(target=y, losses=losses)
            last = float(torch.stack(losses).detach().mean())
        else:
            sched.step()
        opt.step()

    for _ in range(opts["warmup"]):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(opts["steps"]):
        step()
    mine = torch.tensor([(time.perf_counter() - t0) / opts["steps"]])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)    # the slowest rank's time (gloo default group)
    return mine.item(), last


def rank_main(rank: int, world: int, port: int, opts: dict) -> dict:
    torch.set_num_threads(1)   # world ranks share the cores
    import pycoll  # noqa: F401  registers the backend in this fresh process
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store, timeout=timedelta(seconds=120))
    groups = {b: dist.new_group(backend=b) for b in ("gloo", "pycoll")}
    times: dict = {}
    losses: dict = {}
    for r in range(opts["rounds"]):
        order = list(groups) if r % 2 == 0 else list(reversed(groups))
        for schedule in opts["schedules"]:
            for b in order:
                t, loss = _block(schedule, groups[b], rank, world, opts)
                times.setdefault(f"{schedule}/{b}", []).append(t)
                losses[f"{schedule}/{b}"] = loss
    dist.destroy_process_group()
    return {"times": times, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "-n", type=int, default=2)
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="busy processes beside the ranks")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    schedules = [s for s in a.schedules.split(",") if s]
    bad = set(schedules) - set(SCHEDULES)
    if bad:
        p.error(f"unknown schedules {sorted(bad)}: choose from {', '.join(SCHEDULES)}")
    opts = {"hidden": a.hidden, "layers": a.layers, "microbatches": a.microbatches, "batch": a.batch,
            "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "schedules": schedules}
    from pycoll.cli.bench.load import Busy
    from pycoll.testing import spawn

    with Busy(a.load) as load:
        res = spawn.run(rank_main, a.world_size, opts, timeout=1800, context="forkserver",
                        preload=["torch", "torch.distributed"])
    times, losses = res[0]["times"], res[-1]["losses"]
    print(f"# pipelining: {a.world_size} stages x {a.layers} Linear({a.hidden}) layers, {a.microbatches} "
          f"microbatches of {a.batch // a.microbatches}; {a.rounds} rounds x {a.steps} steps; {load.describe()}")
    print(f"{'schedule':<8} {'pycoll steps/s':>15} {'gloo steps/s':>13} {'pycoll/gloo':>12}  per round        final loss (pycoll, gloo)")
    out = {"world": a.world_size, "load": a.load, "opts": opts, "results": {}}
    for s in schedules:
        ours, theirs = times[f"{s}/pycoll"], times[f"{s}/gloo"]
        ratios = [t / o for o, t in zip(ours, theirs)]
        med_o, med_t = statistics.median(ours), statistics.median(theirs)
        print(f"{s:<8} {1 / med_o:>15.1f} {1 / med_t:>13.1f} {med_t / med_o:>12.2f}  "
              f"{' '.join(f'{r:.2f}' for r in ratios):<16} {losses[f'{s}/pycoll']:.6f}, {losses[f'{s}/gloo']:.6f}")
        out["results"][s] = {"pycoll_s": ours, "gloo_s": theirs, "ratio": med_t / med_o,
                             "loss": [losses[f"{s}/pycoll"], losses[f"{s}/gloo"]]}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
