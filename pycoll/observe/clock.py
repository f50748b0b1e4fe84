"""Clock offsets between ranks: rank 0's monotonic clock = this rank's + offset, within a bound.

Measured once per group (``offset_of``) and shared by whoever needs it: the trace (to merge
rank files) and ``pycoll.stats`` (arrivals on one clock).
"""

from __future__ import annotations

import time
import weakref
import zlib

import torch

from pycoll import settings
from pycoll.core import tags
from pycoll.core.executor import byte_view

CLOCK_ROUNDS = 8
_measured: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # communicator -> offset


def offset_of(comm, tag: int = tags.CLOCK) -> tuple[float, float, str]:
    """``sync_clock(comm)``, measured on the first call for ``comm`` (collective then)."""
    got = _measured.get(comm)
    if got is None:
        got = _measured[comm] = sync_clock(comm, tag)
    return got


def _boot_id() -> float:
    """A number naming this kernel: processes under one kernel share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return float(zlib.crc32(f.read().strip()))
    except OSError:
        return -1.0


def sync_clock(comm, tag: int = tags.CLOCK, rounds: int = CLOCK_ROUNDS) -> tuple[float, float, str]:
    """``(offset, error, method)``: rank 0's monotonic clock = this rank's + offset, within ±error.

    Every rank other than 0 runs ping-pongs with rank 0 over the point-to-point engine:
    send t0, rank 0 answers with its clock t1, receive at t2. Rank 0 read t1 between t0 and
    t2, so the offset lies in [t1 - t2, t1 - t0]: the midpoint is the estimate and half the
    round trip the bound, whatever the asymmetry. The sample with the shortest round trip
    wins. Ranks under the same kernel (same boot id) share the clock: offset 0, error 0,
    after one exchange (``PYCOLL_CLOCK_SYNC=measure`` measures anyway, to check the method).
    All ranks of the group must call it together.
    """
    rank, world, eng = comm.rank, comm.world, comm.p2p
    if world == 1:
        return 0.0, 0.0, "single rank"
    boot = _boot_id()
    measure = settings.get("PYCOLL_CLOCK_SYNC") == "measure"  # ping-pong even on one kernel
    deadline = time.monotonic() + comm.timeout

    def xfer(kind, peer, values=None):
        t = torch.tensor(values if values is not None else [0.0, 0.0], dtype=torch.float64)
        fn = eng.isend if kind == "send" else eng.irecv
        req = fn(peer, tag, byte_view(t), "float64", 2, deadline)
        if not eng.wait(req, max(0.0, deadline - time.monotonic())) or req.error is not None:
            raise req.error or TimeoutError(f"clock exchange with rank {peer} timed out")
        return t.tolist()

    if rank == 0:
        for peer in range(1, world):
            for k in range(rounds):
                _, their_boot = xfer("recv", peer)
                xfer("send", peer, [time.monotonic(), boot])
                if their_boot == boot and not measure:
                    break
        return 0.0, 0.0, "rank 0 (reference clock)"
    best = None
    for k in range(rounds):
        t0 = time.monotonic()
        xfer("send", 0, [t0, boot])
        t1, their_boot = xfer("recv", 0)
        t2 = time.monotonic()
        if their_boot == boot and not measure:
            return 0.0, 0.0, "same kernel as rank 0 (shared CLOCK_MONOTONIC)"
        if best is None or t2 - t0 < best[0]:
            best = (t2 - t0, t1 - (t0 + t2) / 2)
    return best[1], best[0] / 2, f"ping-pong with rank 0, best of {rounds} (error <= rtt/2)"
