"""``python -m pycoll demo``: N local ranks on pycoll run every collective once, then train.

The main job of the README: it shows a newcomer, in under a minute, that the backend
works on this machine. Each rank checks every result against the value it must have and
rank 0 prints a table; then torch's DistributedDataParallel trains a small model for a
few steps and the ranks confirm their parameters are identical.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
from datetime import timedelta

CHECKS = []


def check(name):
    def deco(fn):
        CHECKS.append((name, fn))
        return fn
    return deco


@check("all_reduce sum (float32, 1M elements)")
def _all_reduce(dist, torch, rank, world):
    t = torch.full((1 << 20,), float(rank + 1))
    dist.all_reduce(t)
    return bool((t == world * (world + 1) / 2).all())


@check("all_reduce max (int64)")
def _all_reduce_max(dist, torch, rank, world):
    t = torch.tensor([rank, -rank], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() == [world - 1, 0]


@check("broadcast from the last rank")
def _broadcast(dist, torch, rank, world):
    t = torch.arange(1000, dtype=torch.float64) * rank
    dist.broadcast(t, src=world - 1)
    return bool((t == torch.arange(1000, dtype=torch.float64) * (world - 1)).all())


@check("reduce to rank 0")
def _reduce(dist, torch, rank, world):
    t = torch.ones(100) * rank
    dist.reduce(t, dst=0)
    return rank != 0 or bool((t == sum(range(world))).all())


@check("all_gather_single")
def _all_gather(dist, torch, rank, world):
    from pycoll.torch_compat import all_gather_single
    out = torch.empty(world * 3, dtype=torch.int32)
    all_gather_single(out, torch.full((3,), rank, dtype=torch.int32))
    return out.tolist() == [r for r in range(world) for _ in range(3)]


@check("reduce_scatter_single")
def _reduce_scatter(dist, torch, rank, world):
    from pycoll.torch_compat import reduce_scatter_single
    out = torch.empty(4)
    reduce_scatter_single(out, torch.arange(4 * world, dtype=torch.float32))
    return out.tolist() == [float(world * (4 * rank + i)) for i in range(4)]


@check("all_to_all_single (uneven splits)")
def _all_to_all(dist, torch, rank, world):
    send = [r + 1 for r in range(world)]           # rank r sends r'+1 elements to r'
    inp = torch.cat([torch.full((n,), float(rank * 100 + dst)) for dst, n in enumerate(send)])
    out = torch.empty((rank + 1) * world)
    dist.all_to_all_single(out, inp, [rank + 1] * world, send)
    expect = [src * 100 + rank for src in range(world) for _ in range(rank + 1)]
    return out.tolist() == expect


@check("gather and scatter")
def _gather_scatter(dist, torch, rank, world):
    got = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), got, dst=0)
    ok = rank != 0 or [g[0].item() for g in got] == list(map(float, range(world)))
    out = torch.empty(2)
    dist.scatter(out, [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None, src=0)
    return ok and out.tolist() == [float(rank)] * 2


@check("send/recv ring (isend + irecv)")
def _ring(dist, torch, rank, world):
    if world == 1:
        return True
    out = torch.empty(5)
    reqs = [dist.isend(torch.full((5,), float(rank)), (rank + 1) % world),
            dist.irecv(out, (rank - 1) % world)]
    for r in reqs:
        r.wait()
    return out.tolist() == [float((rank - 1) % world)] * 5


@check("all_gather_object")
def _objects(dist, torch, rank, world):
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pid": os.getpid()})
    return [o["rank"] for o in objs] == list(range(world))


@check("barrier")
def _barrier(dist, torch, rank, world):
    dist.barrier()
    return True


def _rank_main(rank: int, world: int, port: int, steps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import pycoll  # noqa: F401  registers the backend

    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the cores are shared, as torchrun assumes
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("pycoll", rank=rank, world_size=world, store=store,
                            timeout=timedelta(seconds=60))
    rows = []
    for name, fn in CHECKS:
        t0 = time.perf_counter()
        ok = fn(dist, torch, rank, world)
        rows.append((name, ok, (time.perf_counter() - t0) * 1e3))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(64, 32, generator=gen), torch.randint(0, 4, (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], e) for e in everyone)
    dist.destroy_process_group()
    queue.put((rank, rows, losses, same))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pycoll demo", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", "-n", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="DDP training steps")
    args = ap.parse_args(argv)
    import torch.distributed as dist

    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, args.world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world_size, store.port, args.steps, queue))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 120
    try:
        while len(results) < args.world_size:
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                print("a rank failed or timed out; see its traceback above", file=sys.stderr)
                return 1
            try:
                rank, rows, losses, same = queue.get(timeout=0.5)
            except queue_mod.Empty:
                continue
            results[rank] = (rows, losses, same)
    finally:
        for p in procs:
            p.join(10 if len(results) == args.world_size else 0)
            if p.is_alive():
                p.kill()
    print(f"pycoll demo: {args.world_size} ranks on this machine, backend 'pycoll'\n")
    print(f"{'collective':42} {'ok on all ranks':>16} {'time (ms)':>10}")
    all_ok = True
    for i, (name, _, ms) in enumerate(results[0][0]):
        ok = all(results[r][0][i][1] for r in results)
        all_ok &= ok
        print(f"{name:42} {'yes' if ok else 'NO':>16} {ms:10.2f}")
    losses = results[0][1]
    same = all(results[r][2] for r in results)
    print(f"\ntorch DDP, {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"parameters identical on all ranks: {'yes' if same else 'NO'}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0 if all_ok and same else 1
