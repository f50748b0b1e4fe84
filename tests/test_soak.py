"""Soak: thousands of random collectives on 3 ranks over TCP, every result checked.

Each operation is drawn from a seeded generator that every rank shares (collective, size
0..1 MiB log-uniform, dtype, reduce op, root, sync or async), inputs are a deterministic
function of (operation, rank), so every rank computes the exact expected result of every
rank locally (integer-valued data: exact in every dtype, bfloat16 included). fd count,
pycoll threads and RSS are sampled after warm-up and at the end and must stay flat.

The default suite runs 2,000 operations; ``PYCOLL_SLOW=1`` adds the 20,000-operation run
(marked ``slow``).
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import run_ranks

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


def _run(n_ops):
    res = run_ranks(_soak, 3, n_ops, 1, backend="pycoll", timeout=900,
                    env={"PYCOLL_TRANSPORT": "tcp"})
    for r, s in enumerate(res):
        (f0, t0, m0), (f1, t1, m1) = s["warm"], s["end"]
        assert f1 <= f0 and t1 == t0, (r, s)
        # Current RSS swings by up to ~30 MiB with glibc's heap (measured over 1000-4000 ops,
        # no trend); a leak of 64 KiB per op over the second half would still fail this.
        assert m1 - m0 < 64, (r, s)
    print(f"\n{n_ops} ops on 3 ranks: {res[0]['seconds']:.1f} s; "
          + "; ".join(f"rank {r}: fds {s['warm'][0]}->{s['end'][0]}, threads {s['end'][1]}, "
                      f"RSS {s['warm'][2]:.0f}->{s['end'][2]:.0f} MiB" for r, s in enumerate(res)))


@pytest.mark.timeout(300)
def test_soak_2000_random_ops():
    _run(2000)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not os.environ.get("PYCOLL_SLOW"), reason="20,000-op soak: set PYCOLL_SLOW=1")
def test_soak_20000_random_ops():
    _run(20000)
