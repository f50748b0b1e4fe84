"""The soak: random collectives (op, dtype, size, root, async) checked against a reference
every step, with the process's fds, threads and RSS sampled as it goes.
"""

from __future__ import annotations

import os
import random
import threading
import time

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16, torch.int8]


OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "all_to_all", "barrier"]


REDOPS = {"sum": (dist.ReduceOp.SUM, lambda xs: sum(xs[1:], xs[0].clone())),
          "max": (dist.ReduceOp.MAX, lambda xs: torch.stack(xs).amax(0)),
          "min": (dist.ReduceOp.MIN, lambda xs: torch.stack(xs).amin(0)),
          "product": (dist.ReduceOp.PRODUCT, lambda xs: xs[0] * xs[1] * xs[2])}


def _data(i, r, n, dtype):
    return ((torch.arange(n, dtype=torch.int64) * (r + 1) + i) % 7 - 3).to(dtype)


def _state():
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return (len(os.listdir("/proc/self/fd")),
            sum(t.name.startswith("pycoll") for t in threading.enumerate()), rss)


def _soak(rank, world, n_ops, seed):
    pending: list = []
    samples = {}
    t0 = time.time()

    def flush():
        for work, check in pending:
            work.wait()
            check()
        pending.clear()

    for i in range(n_ops):
        rng = random.Random(seed * 1_000_003 + i)
        op, dtype = rng.choice(OPS), rng.choice(DTYPES)
        nbytes = 0 if rng.random() < 0.05 else int(2 ** rng.uniform(0, 20))
        n = max(0, nbytes // dtype.itemsize) // world * world
        async_op = rng.random() < 0.3
        root = rng.randrange(world)
        xs = [_data(i, r, n, dtype) for r in range(world)]
        mine = xs[rank].clone()
        if op == "all_reduce":
            name = rng.choice(list(REDOPS))
            redop, ref = REDOPS[name]
            expect = ref(xs)
            work = dist.all_reduce(mine, op=redop, async_op=async_op)
            out = mine
        elif op == "broadcast":
            expect, out = xs[root], mine
            work = dist.broadcast(mine, root, async_op=async_op)
        elif op == "all_gather":
            out = torch.empty(n * world, dtype=dtype)
            expect = torch.cat(xs)
            work = dist.all_gather_into_tensor(out, mine, async_op=async_op)
        elif op == "reduce_scatter":
            out = torch.empty(n // world, dtype=dtype)
            expect = sum(xs[1:], xs[0].clone())[rank * (n // world):(rank + 1) * (n // world)]
            work = dist.reduce_scatter_tensor(out, mine, async_op=async_op)
        elif op == "reduce":
            expect = sum(xs[1:], xs[0].clone()) if rank == root else xs[rank]
            work = dist.reduce(mine, root, async_op=async_op)
            out = mine
        elif op == "all_to_all":
            out = torch.empty(n, dtype=dtype)
            k = n // world
            expect = torch.cat([xs[r][rank * k:(rank + 1) * k] for r in range(world)])
            work = dist.all_to_all_single(out, mine, async_op=async_op)
        else:
            out = expect = torch.empty(0)
            work = dist.barrier(async_op=async_op)

        def check(out=out, expect=expect, i=i, op=op, dtype=dtype, n=n):
            assert torch.equal(out, expect), f"op {i}: {op} {dtype}[{n}] wrong on rank {rank}"
        if async_op:
            pending.append((work, check))
            if len(pending) >= 4:
                flush()
        else:
            flush()
            check()
        # Sampled half-way: glibc's heap settles over the first few hundred ops, a leak
        # keeps growing through the second half.
        if i == n_ops // 2:
            samples["warm"] = _state()
    flush()
    samples["end"] = _state()
    samples["seconds"] = time.time() - t0
    return samples
