"""Run a benchmark's rank function in ``world`` fresh processes around a Store on port 0.

The experiments in tools/ that need fresh processes (not the bench's pooled ranks) start
them the same way: ``run(target, world, opts)`` spawns ``target(rank, world, port, opts,
queue)`` with a TCPStore that this process hosts on a port the OS picks; the rank reports
through ``report(queue, rank, fn)``, which sends fn()'s value or the failure's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import traceback
from datetime import timedelta

import torch.distributed as dist


def report(queue, rank: int, fn) -> None:
    """Put (rank, "ok", fn()) on ``queue``, or (rank, "err", the traceback) if fn raises."""
    try:
        queue.put((rank, "ok", fn()))
    except BaseException as e:  # noqa: BLE001 - the parent prints it
        queue.put((rank, "err", f"{e}\n{traceback.format_exc()}"))


def run(target, world: int, opts, timeout: float = 1800) -> list | None:
    """Every rank's value, by rank; None (after printing the failing rank's error) if one
    failed. Ranks that do not report within ``timeout`` seconds raise ``queue.Empty``."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, store.port, opts, queue), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    results: list = [None] * world
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                print(f"rank {rank} failed: {value}", file=sys.stderr)
                return None
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return results
