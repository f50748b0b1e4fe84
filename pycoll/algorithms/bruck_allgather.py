"""Bruck all-gather: ceil(log2 P) rounds on any world size; for small messages.

Rank r works in a temp of P*count elements whose block i will hold rank (r+i)'s data;
it starts with its own "in" in block 0. In round k (distance d = 2^k) rank r sends its
first min(d, P-d) blocks to r-d and receives the same number into blocks [d, ...) from r+d
(whose first blocks are the data of ranks r+d, r+d+1, ...). After the last round the temp
holds all P blocks rotated by r; two local copies rotate them into "out" (block i of the
temp goes to block (r+i) % P).

Steps: ceil(log2 P) (+2 local). Bytes sent per rank: n*(P-1) with n = count. Cost:
ceil(log2 P)*alpha + n*(P-1)*beta, plus the local rotation. Latency-optimal for any P; the
rotation copies the whole output, so for large messages ring is cheaper.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, clog2, cost_of
from pycoll.algorithms.schedule import Copy, Recv, Schedule, Send


def schedule(rank: int, world: int, count: int) -> Schedule:
    s = Schedule("bruck_allgather", rank, world)
    if world == 1:
        s.add(Copy("in", 0, "out", 0, count))
        return s
    s.temps["tmp"] = world * count
    s.add(Copy("in", 0, "tmp", 0, count))
    d = 1
    while d < world:
        nb = min(d, world - d)
        s.add(Send((rank - d) % world, "tmp", 0, nb * count),
              Recv((rank + d) % world, "tmp", d * count, nb * count))
        d <<= 1
    head = world - rank  # temp blocks [0, head) belong to ranks r..P-1
    s.add(Copy("tmp", 0, "out", rank * count, head * count),
          Copy("tmp", head * count, "out", 0, rank * count))
    return s


def terms(world: int, n: float) -> Terms:
    """ceil(log2 P) alpha + n(P-1) beta, n = one rank's block (the rotation is in copied)."""
    return Terms(clog2(world), n * (world - 1), 0)


def copied(world: int, n: float) -> float:
    """"in" into the temp (n), then the rotation of the whole temp into "out" (nP)."""
    return n if world == 1 else n * (world + 1)


cost = cost_of(terms, copied, block=True)
