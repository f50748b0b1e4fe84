"""Monitored barrier: like gloo's, rank 0 reports which ranks failed to arrive in time.

Runs over the point-to-point engine with a tag of its own per call, so a rank that misses
the deadline does not break the group's collective channel.
"""

from __future__ import annotations

import time

import torch

from .errors import CommTimeoutError, PycollError
from .executor import byte_view
from .work import completed


def monitored_barrier(pg, tag: int, timeout, wait_all_ranks: bool):
    rank, world, eng = pg.rank(), pg.size(), pg._comm.p2p
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    deadline = time.monotonic() + seconds
    token = byte_view(torch.zeros(1, dtype=torch.uint8))
    if world == 1:
        return completed("monitored_barrier", [])
    if rank != 0:
        eng.isend(0, tag, token, "uint8", 1, deadline)
        ack = eng.irecv(0, tag, byte_view(torch.zeros(1, dtype=torch.uint8)), "uint8", 1, deadline)
        if not ack.done.wait(max(0.0, deadline - time.monotonic()) + 1) or ack.error is not None:
            raise CommTimeoutError(f"[Rank {rank}]: monitored barrier timed out after {seconds} s "
                                   f"waiting for rank 0", op="monitored_barrier", rank=rank, peer=0)
        return completed("monitored_barrier", [])
    reqs = {p: eng.irecv(p, tag, byte_view(torch.zeros(1, dtype=torch.uint8)), "uint8", 1, deadline)
            for p in range(1, world)}
    missing = []
    for p, req in reqs.items():
        req.done.wait(max(0.0, deadline - time.monotonic()) + 1)
        if req.error is not None or not req.done.is_set():
            missing.append(p)
            if not wait_all_ranks:
                break
    if missing:
        ranks = ", ".join(map(str, missing))
        noun = "Rank" if len(missing) == 1 else "Ranks"
        raise PycollError(f"[Rank 0]: {noun} {ranks} failed to pass monitoredBarrier in "
                          f"{int(seconds * 1000)} ms")
    for p in range(1, world):
        eng.isend(p, tag, token, "uint8", 1, deadline)
    return completed("monitored_barrier", [])
