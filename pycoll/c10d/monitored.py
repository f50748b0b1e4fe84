"""Monitored barrier: like gloo's, rank 0 reports which ranks failed to arrive in time.

Runs over the point-to-point engine with a tag of its own per call, so a rank that misses
the deadline does not break the group's collective channel.
"""

from __future__ import annotations

import time

import torch

from pycoll.core.executor import byte_view
from pycoll.core.work import completed
from pycoll.errors import CommTimeoutError, PycollError


def monitored_barrier(pg, tag: int, timeout, wait_all_ranks: bool):
    """``timeout``: the barrier's own (a timedelta or seconds; 0 is zero time, not unset)."""
    rank, world, eng = pg.rank(), pg.size(), pg.communicator.p2p
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    ms = round(seconds * 1000)
    deadline = time.monotonic() + seconds
    token = byte_view(torch.zeros(1, dtype=torch.uint8))
    if world == 1:
        return completed("monitored_barrier", [])
    if rank != 0:
        # As gloo: only rank 0 enforces the timeout, so that it, not another rank, reports
        # which rank is missing; the others wait a second longer for its verdict.
        eng.isend(0, tag, token, "uint8", 1, deadline)
        ack = eng.irecv(0, tag, byte_view(torch.zeros(1, dtype=torch.uint8)), "uint8", 1, deadline + 1)
        if not eng.wait(ack, max(0.0, deadline - time.monotonic()) + 1) or ack.error is not None:
            error = CommTimeoutError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                f"for send/recv from rank 0. Please check rank 0 logs for faulty rank.",
                op="monitored_barrier", rank=rank, peer=0)
            error.timeout_s = seconds
            raise error
        return completed("monitored_barrier", [])
    reqs = {p: eng.irecv(p, tag, byte_view(torch.zeros(1, dtype=torch.uint8)), "uint8", 1, deadline)
            for p in range(1, world)}
    missing, passed = [], []
    for p, req in reqs.items():
        left = deadline - time.monotonic()
        # The engine may already have failed a receive whose deadline passed: that is the
        # same time-out, not a rank that failed, so gloo's wording holds either way.
        arrived = req.done.is_set() and req.error is None
        if left <= 0 and not wait_all_ranks and not arrived:
            done = ", ".join(map(str, passed))
            raise PycollError(f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n"
                              + (f"Successfully processed ranks: {done}" if passed
                                 else "No ranks successfully processed in monitoredBarrier."))
        eng.wait(req, max(0.0, left))
        if req.error is not None or not req.done.is_set():
            missing.append(p)
            if not wait_all_ranks:
                break
        else:
            passed.append(p)
    if missing:
        ranks = ", ".join(map(str, missing))
        noun = "Rank" if len(missing) == 1 else "Ranks"
        raise PycollError(f"[Rank 0]: {noun} {ranks} failed to pass monitoredBarrier in {ms} ms")
    for p in range(1, world):
        eng.isend(p, tag, token, "uint8", 1, deadline)
    return completed("monitored_barrier", [])
