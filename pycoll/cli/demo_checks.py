"""The demo's collectives, each a small table entry, and the harness that checks and times them.

An entry (after nccl-tests: one tiny function per collective, a shared harness) builds this
rank's buffers for one group and returns a :class:`Case`: ``run()`` issues the collective on
that group, ``verify()`` says whether the buffers now hold the value they must and returns
them, so that the harness can also compare pycoll's result with gloo's on the same inputs.

The harness runs every entry once per backend (correctness), then times them: rounds of the
whole table, the backends alternating which goes first, each timed block a fresh ``setup``
(not timed), a barrier on the group, and ``iters`` back-to-back calls. Each rank reports its
own microseconds per call; the parent takes the slowest rank per block and the median over
rounds, so a noisy moment of a shared machine hits both backends alike.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from pycoll.torch_compat import all_gather_single, reduce_scatter_single


class Ctx(NamedTuple):
    rank: int
    world: int
    group: object


class Case(NamedTuple):
    run: Callable[[], object]
    verify: Callable[[], tuple]   # -> (correct on this rank, outputs to compare across backends)
    nbytes: int                   # this rank's input, bytes


class Entry(NamedTuple):
    name: str
    iters: int                    # calls per timed block
    setup: Callable[[Ctx], Case]


COLLECTIVES: list[Entry] = []


def collective(name: str, iters: int = 8):
    def deco(fn):
        COLLECTIVES.append(Entry(name, iters, fn))
        return fn
    return deco


@collective("all_reduce sum float32", iters=3)
def _all_reduce(c: Ctx) -> Case:
    t = torch.full((1 << 20,), float(c.rank + 1))
    want = c.world * (c.world + 1) / 2
    return Case(lambda: dist.all_reduce(t, group=c.group),
                lambda: (bool((t == want).all()), [t]), t.numel() * 4)


@collective("all_reduce max int64")
def _all_reduce_max(c: Ctx) -> Case:
    t = torch.tensor([c.rank, -c.rank], dtype=torch.int64)
    return Case(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=c.group),
                lambda: (t.tolist() == [c.world - 1, 0], [t]), 16)


@collective("broadcast from the last rank")
def _broadcast(c: Ctx) -> Case:
    t = torch.arange(1024, dtype=torch.float64) * c.rank
    want = torch.arange(1024, dtype=torch.float64) * (c.world - 1)
    return Case(lambda: dist.broadcast(t, src=c.world - 1, group=c.group),
                lambda: (torch.equal(t, want), [t]), 8192)


@collective("reduce sum to rank 0")
def _reduce(c: Ctx) -> Case:
    t = torch.ones(100) * c.rank
    return Case(lambda: dist.reduce(t, dst=0, group=c.group),
                lambda: (c.rank != 0 or bool((t == sum(range(c.world))).all()),
                         [t] if c.rank == 0 else []), 400)


@collective("all_gather_single int32", iters=5)
def _all_gather(c: Ctx) -> Case:
    n = 1 << 16
    out = torch.empty(c.world * n, dtype=torch.int32)
    inp = torch.full((n,), c.rank, dtype=torch.int32)
    want = torch.arange(c.world, dtype=torch.int32).repeat_interleave(n)
    return Case(lambda: all_gather_single(out, inp, group=c.group),
                lambda: (torch.equal(out, want), [out]), n * 4)


@collective("reduce_scatter_single")
def _reduce_scatter(c: Ctx) -> Case:
    out, inp = torch.empty(4), torch.arange(4 * c.world, dtype=torch.float32)
    return Case(lambda: reduce_scatter_single(out, inp, group=c.group),
                lambda: (out.tolist() == [float(c.world * (4 * c.rank + i)) for i in range(4)],
                         [out]), inp.numel() * 4)


@collective("all_to_all_single uneven")
def _all_to_all(c: Ctx) -> Case:
    send = [r + 1 for r in range(c.world)]           # rank r sends r'+1 elements to r'
    inp = torch.cat([torch.full((n,), float(c.rank * 100 + dst)) for dst, n in enumerate(send)])
    out = torch.empty((c.rank + 1) * c.world)
    expect = [src * 100 + c.rank for src in range(c.world) for _ in range(c.rank + 1)]
    return Case(lambda: dist.all_to_all_single(out, inp, [c.rank + 1] * c.world, send,
                                               group=c.group),
                lambda: (out.tolist() == expect, [out]), inp.numel() * 4)


@collective("gather + scatter")
def _gather_scatter(c: Ctx) -> Case:
    got = [torch.empty(2) for _ in range(c.world)] if c.rank == 0 else None
    parts = [torch.full((2,), float(r)) for r in range(c.world)] if c.rank == 0 else None
    out = torch.empty(2)

    def run():
        dist.gather(torch.full((2,), float(c.rank)), got, dst=0, group=c.group)
        dist.scatter(out, parts, src=0, group=c.group)

    def verify():
        ok = c.rank != 0 or [g[0].item() for g in got] == list(map(float, range(c.world)))
        return ok and out.tolist() == [float(c.rank)] * 2, (got or []) + [out]
    return Case(run, verify, 8)


@collective("isend/irecv ring")
def _ring(c: Ctx) -> Case:
    out, inp = torch.empty(5), torch.full((5,), float(c.rank))

    def run():
        if c.world > 1:
            reqs = [dist.isend(inp, (c.rank + 1) % c.world, group=c.group),
                    dist.irecv(out, (c.rank - 1) % c.world, group=c.group)]
            for r in reqs:
                r.wait()
        else:
            out.copy_(inp)
    return Case(run, lambda: (out.tolist() == [float((c.rank - 1) % c.world)] * 5, [out]), 20)


@collective("all_gather_object")
def _objects(c: Ctx) -> Case:
    objs = [None] * c.world
    mine = {"rank": c.rank, "pid": os.getpid()}
    return Case(lambda: dist.all_gather_object(objs, mine, group=c.group),
                lambda: ([o["rank"] for o in objs] == list(range(c.world)), [objs]), 0)


@collective("barrier")
def _barrier(c: Ctx) -> Case:
    return Case(lambda: dist.barrier(group=c.group), lambda: (True, []), 0)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def check_all(rank: int, world: int, groups: dict) -> list[dict]:
    """Each collective once per backend: correct on this rank, and the same on every backend."""
    rows = []
    for entry in COLLECTIVES:
        ok, outs, nbytes = {}, {}, 0
        for name, group in groups.items():
            case = entry.setup(Ctx(rank, world, group))
            case.run()   # (one that raises ends this rank: the parent reports it and fails)
            ok[name], outs[name] = case.verify()
            nbytes = case.nbytes
        first = next(iter(outs.values()))
        rows.append({"name": entry.name, "bytes": nbytes, "ok": ok,
                     "same": all(_equal(first, o) for o in outs.values()), "us": {}})
    return rows


def time_all(rank: int, world: int, groups: dict, rows: list[dict], rounds: int) -> None:
    """Adds ``row["us"][backend]``: this rank's microseconds per call, one value per round."""
    names = list(groups)
    for row in rows:
        row["us"] = {name: [] for name in names}
    for r in range(rounds):
        for i, (entry, row) in enumerate(zip(COLLECTIVES, rows)):
            for name in (names if (r + i) % 2 == 0 else names[::-1]):
                case = entry.setup(Ctx(rank, world, groups[name]))
                dist.barrier(group=groups[name])
                t0 = time.perf_counter()
                for _ in range(entry.iters):
                    case.run()
                row["us"][name].append((time.perf_counter() - t0) / entry.iters * 1e6)
