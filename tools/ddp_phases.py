"""Where a DDP step's time goes: forward, backward, optimizer and the wait after backward.

    python tools/ddp_phases.py [--model mlp|convnet] [--rounds 5] [--steps 8]
                               [--configs indep,ours,nocomm,view,ours_fp16,torch,torch_gloo]

Two rank processes (one torch thread each) build every configuration once and time them in
turns, each turn ``--steps`` steps (the first two untimed), so that a noisy phase of this
shared machine hits all alike; per rank it prints the median milliseconds of each phase.
Configurations: ``indep`` (no DDP), ``ours`` (ddp/ on a pycoll group: shared buckets on one
host), ``nocomm`` (ours with a comm hook that returns the bucket at once: the copies and hooks
alone), ``one`` (ours with all gradients in one bucket, reduced after backward: what ``ours``
does where no core is spare, ``ddp.buckets.overlap_pays``), ``overlap`` (ours with torch's 25 MB
buckets, reduced during backward, whatever the cores), ``sync``
(``indep`` plus a 4-byte all_reduce after each step: what waiting for the slower rank costs),
``view`` (ours with ``gradient_as_bucket_view``), ``ours_fp16``/``ours_bf16`` (ours with
the compression hooks), ``torch``/``torch_fp16`` (torch's DDP on pycoll), ``torch_one`` (torch's DDP on pycoll with one
bucket: ``bucket_cap_mb=1e4``), ``torch_gloo``/
``torch_gloo_fp16`` (torch's DDP on gloo). For ours, "tail" is the time from the end of backward
to the gradients written back (``DistributedDataParallel.timeline``), and the last round's
buckets are printed (index, MiB, ready and reduced, ms after backward began). The models are
tools/bench_ddp.py's. docs/ddp.md, "Where a step's time goes", has a run.
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
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from pycoll.testing import spawn  # noqa: E402

PHASES = ("fwd", "bwd", "opt", "step", "tail")


def _configs(pg, gloo, build):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddp import DistributedDataParallel as Ours
    from ddp import hooks

    def hooked(model, hook, group):
        model.register_comm_hook(group, hook)
        return model

    def at_once(_state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    torch_ddp = nn.parallel.DistributedDataParallel
    return {
        "indep": lambda: build(),
        "ours": lambda: Ours(build(), process_group=pg),
        "nocomm": lambda: hooked(Ours(build(), process_group=pg), at_once, None),
        "one": lambda: Ours(build(), process_group=pg, bucket_cap_mb=1e4, first_bucket_cap_mb=1e4),
        "overlap": lambda: Ours(build(), process_group=pg, bucket_cap_mb=25, first_bucket_cap_mb=1),
        "sync": lambda: build(),
        "view": lambda: Ours(build(), process_group=pg, gradient_as_bucket_view=True),
        "ours_fp16": lambda: hooked(Ours(build(), process_group=pg), hooks.fp16_compress_hook, pg),
        "ours_bf16": lambda: hooked(Ours(build(), process_group=pg), hooks.bf16_compress_hook, pg),
        "torch": lambda: torch_ddp(build(), process_group=pg),
        "torch_one": lambda: torch_ddp(build(), process_group=pg, bucket_cap_mb=1e4),
        "torch_fp16": lambda: hooked(torch_ddp(build(), process_group=pg), default_hooks.fp16_compress_hook, pg),
        "torch_gloo": lambda: torch_ddp(build(), process_group=gloo),
        "torch_gloo_fp16": lambda: hooked(torch_ddp(build(), process_group=gloo),
                                          default_hooks.fp16_compress_hook, gloo),
    }


def _phases(rank: int, world: int, port: int, args) -> tuple:
    torch.set_num_threads(1)
    import pycoll  # noqa: F401  (registers the backend)
    from tools import bench_ddp

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    pg, gloo = dist.new_group(backend="pycoll"), dist.new_group(backend="gloo")
    build, inputs = bench_ddp.MODELS[args.model]
    torch.manual_seed(0)
    x, y = inputs(), torch.randint(0, 10, (32,))
    tiny = torch.zeros(1)
    every = _configs(pg, gloo, build)
    models = {k: every[k]() for k in args.configs}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times = {k: {p: [] for p in PHASES} for k in models}
    buckets = None
    for _ in range(args.rounds):
        for k, model in models.items():
            dist.barrier()
            for i in range(args.steps):
                t0 = time.perf_counter()
                opts[k].zero_grad(set_to_none=False)
                loss = nn.functional.cross_entropy(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opts[k].step()
                if k == "sync":
                    dist.all_reduce(tiny, group=pg)
                t3 = time.perf_counter()
                if i < 2:
                    continue
                for p, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[k][p].append(v)
                tl = getattr(model, "timeline", None)
                if tl is not None and hasattr(tl, "finalized"):
                    times[k]["tail"].append(tl.finalized - tl.backward_end)
                    if k == "ours":
                        buckets = [(b.index, round(b.nbytes / 2**20, 1), round((b.ready - tl.backward_start) * 1e3, 1),
                                    round((b.end - tl.backward_start) * 1e3, 1)) for b in tl.buckets]
    dist.barrier()
    dist.destroy_process_group()
    return ({k: {p: round(statistics.median(v) * 1e3, 1) for p, v in ph.items() if v}
             for k, ph in times.items()}, buckets)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp", choices=("mlp", "convnet"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--configs", default="indep,ours,nocomm,view,ours_fp16,torch,torch_gloo")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    args.configs = args.configs.split(",")
    try:
        results = spawn.run(_phases, 2, args, timeout=600)
    except spawn.RankFailed as exc:
        sys.exit(str(exc))
    for rank, (figures, buckets) in enumerate(results):
        print(f"rank {rank} ({args.model}, ms, medians): " + ", ".join(PHASES))
        for k, ph in figures.items():
            print(f"  {k:16s} " + "  ".join(f"{p} {ph[p]:7.1f}" for p in PHASES if p in ph))
        if buckets:
            print(f"  ours' buckets (index, MiB, ready, reduced): {buckets}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
