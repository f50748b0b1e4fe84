"""Registered (``pycoll.empty_shared``) against staged shared-memory collectives, one run.

    python tools/bench_registered.py [--world-size 2] [--sizes 1M,2M,4M,8M,16M,32M,64M]
        [--iters 40] [--chunk 5] [--dtype float32] [--ref-seconds 0.5]
        [--collective all_reduce|all_gather|reduce_scatter]

all_gather is ``all_gather_into_tensor`` in place (the input is the rank's block of the
output, as FSDP2 calls it) and reduce_scatter is ``reduce_scatter_tensor``; the size is
the larger buffer (the gathered output, the scattered input), and their busbw is algbw x
(P-1)/P, as nccl-tests.

``world_size`` ranks on one host (a pycoll group over shared memory, one torch thread each,
as under torchrun). For each size, every rank holds a registered tensor and an ordinary
one; the two are all-reduced in alternating chunks of ``--chunk`` back-to-back ops until
each has ``--iters``, so a slow phase of the machine hits both alike. Each op's time is the
slowest rank's; the table gives medians, busbw (algbw x 2(P-1)/P, as nccl-tests) and the
one-host bound that ``python -m pycoll bench`` prints: each rank must read and write n bytes, one
copy, at the rate each of P one-thread processes copies while all copy at once (measured
before and after the ranks; the better is kept). Each variant is checked once (#wrong).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pycoll.testing import spawn  # noqa: E402


def _rank(rank: int, world: int, port: int, opts: dict) -> dict:
    torch.set_num_threads(1)
    import pycoll

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("pycoll", rank=rank, world_size=world, store=store,
                            timeout=timedelta(seconds=120))
    dtype = getattr(torch, opts["dtype"])
    item = torch.empty(0, dtype=dtype).element_size()
    out = {}
    for nbytes in opts["sizes"]:
        n = nbytes // item
        n -= n % world
        bufs = {"registered": pycoll.empty_shared(n, dtype=dtype), "staged": torch.empty(n, dtype=dtype)}
        run, wrong = _collective(opts["collective"], rank, world, n, dtype), {}
        for name, t in bufs.items():
            wrong[name] = run(t, check=True)
        times = {name: [] for name in bufs}
        for name, t in bufs.items():      # warm-up
            run(t)
        while min(len(v) for v in times.values()) < opts["iters"]:
            for name, t in bufs.items():
                for _ in range(opts["chunk"]):
                    t0 = time.perf_counter()
                    run(t)
                    times[name].append(time.perf_counter() - t0)
        out[nbytes] = {"times": times, "wrong": wrong}
        del bufs
    dist.destroy_process_group()
    return out


def _collective(name: str, rank: int, world: int, n: int, dtype):
    """``run(t, check=False)``: one op on buffer ``t`` (n elements); with check, the number
    of wrong elements (then zeros, so repeated sums cannot overflow)."""
    m = n // world
    small = torch.empty(m, dtype=dtype)
    # torch 2.13 names them *_single and warns on the old names; older torch has only those.
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    def all_reduce(t, check=False):
        if check:
            t.fill_(rank + 1)
        dist.all_reduce(t)
        if check:
            bad = int((t != world * (world + 1) / 2).sum())
            t.zero_()
            return bad

    def all_gather(t, check=False):
        mine = t[rank * m:(rank + 1) * m]
        if check:
            mine.fill_(rank + 1)
        gather(t, mine)
        if check:
            want = torch.arange(1, world + 1, dtype=dtype).repeat_interleave(m)
            return int((t != want).sum())

    def reduce_scatter(t, check=False):
        if check:
            t.fill_(rank + 1)
        scatter(small, t)
        if check:
            bad = int((small != world * (world + 1) / 2).sum())
            t.zero_()
            return bad

    return {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter}[name]


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default="1M,2M,4M,8M,16M,32M,64M")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--chunk", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ref-seconds", type=float, default=0.5)
    p.add_argument("--collective", default="all_reduce", choices=("all_reduce", "all_gather", "reduce_scatter"))
    a = p.parse_args(argv)
    from pycoll.cli.bench import ref

    world = a.world_size
    opts = {"sizes": [_size(s) for s in a.sizes.split(",") if s], "iters": a.iters, "chunk": a.chunk,
            "dtype": a.dtype, "collective": a.collective}
    before = ref.memcpy_per_rank(a.ref_seconds, world) / 1e9 if a.ref_seconds > 0 else 0.0
    try:
        results = spawn.run(_rank, world, opts)
    except spawn.RankFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    after = ref.memcpy_per_rank(a.ref_seconds, world) / 1e9 if a.ref_seconds > 0 else 0.0
    copy_rate = max(before, after)
    factor = (2 if a.collective == "all_reduce" else 1) * (world - 1) / world
    # One copy of the larger buffer at the per-rank copy rate, as ref.all_reduce_bound.
    bound = copy_rate * factor if copy_rate and world > 1 else float("nan")
    print(f"# {a.collective} world {world} {a.dtype} op sum, {a.iters} ops each, chunks of {a.chunk} alternating; "
          f"median of the slowest rank's time per op")
    print(f"# one-host bound: {copy_rate:.2f} GB/s copied by each of {world} one-thread processes at once "
          f"(before {before:.2f}, after {after:.2f}) -> busbw bound {bound:.2f} GB/s")
    print(f"{'size':>8} {'staged us':>10} {'busbw':>7} {'registered us':>14} {'busbw':>7} {'speedup':>8} "
          f"{'reg/bound':>9} {'#wrong':>7}")
    rows = []
    for nbytes in opts["sizes"]:
        med = {}
        for name in ("staged", "registered"):
            per_op = [max(ts) for ts in zip(*(r[nbytes]["times"][name] for r in results))]
            med[name] = statistics.median(per_op)
        bw = {k: nbytes / v / 1e9 * factor for k, v in med.items()}
        wrong = sum(r[nbytes]["wrong"][k] for r in results for k in ("staged", "registered"))
        rows.append((nbytes, med, bw))
        print(f"{nbytes >> 20:>6}Mi {med['staged'] * 1e6:>10.0f} {bw['staged']:>7.2f} {med['registered'] * 1e6:>14.0f} "
              f"{bw['registered']:>7.2f} {med['staged'] / med['registered']:>7.2f}x {bw['registered'] / bound:>8.0%} "
              f"{wrong:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
