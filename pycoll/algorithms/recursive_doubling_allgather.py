"""Recursive-doubling all-gather for power-of-two worlds (Bruck on others); small messages.

Rank r copies "in" into its block of "out" (block r at r*count). In round k (mask 2^k) it
exchanges with r XOR mask: it sends the aligned group of mask blocks it holds and receives
the partner's group, doubling what it holds. On a world that is not a power of two it
returns the Bruck schedule (same step count and bytes), so that ``PYCOLL_ALGO=
recursive_doubling`` works on every world size.

Steps: log2 P (+1 local copy). Bytes sent per rank: n*(P-1) with n = count. Cost:
log2(P)*alpha + n*(P-1)*beta. Same cost as Bruck without its temp and rotation.
"""

from __future__ import annotations

from pycoll.algorithms import bruck_allgather
from pycoll.algorithms.cost import Terms, clog2, cost_of
from pycoll.algorithms.schedule import Copy, Recv, Schedule, Send


def schedule(rank: int, world: int, count: int) -> Schedule:
    if world & (world - 1):
        return bruck_allgather.schedule(rank, world, count)
    s = Schedule("recursive_doubling_allgather", rank, world)
    s.add(Copy("in", 0, "out", rank * count, count))
    mask = 1
    while mask < world:
        mine, peer = rank & ~(mask - 1), rank ^ mask
        theirs = peer & ~(mask - 1)
        s.add(Send(peer, "out", mine * count, mask * count),
              Recv(peer, "out", theirs * count, mask * count))
        mask <<= 1
    return s


def terms(world: int, n: float) -> Terms:
    """log2 P alpha + n(P-1) beta, n = one rank's block (Bruck's off powers of two)."""
    return Terms(clog2(world), n * (world - 1), 0)


def copied(world: int, n: float) -> float:
    """Its own block into "out" (n); Bruck's copies off powers of two."""
    return bruck_allgather.copied(world, n) if world & (world - 1) else n


cost = cost_of(terms, copied, block=True)
