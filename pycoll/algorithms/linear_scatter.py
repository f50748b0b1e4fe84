"""Linear scatter from ``root``: the root's "in" holds world*count elements in rank blocks;
every rank's "out" gets its ``count``-element block.

The root sends block i to rank i for every i != root in one step (run concurrently by the
transport) and copies its own block locally; every other rank receives once.

Steps: 1. Bytes sent by the root: n*(P-1) with n = count; others send nothing. Cost:
alpha + n*(P-1)*beta at the root's link. The one scatter algorithm.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of
from pycoll.algorithms.schedule import Copy, Recv, Schedule, Send


def schedule(rank: int, world: int, count: int, root: int) -> Schedule:
    s = Schedule("linear_scatter", rank, world)
    if rank != root:
        s.add(Recv(root, "out", 0, count))
        return s
    s.add(Copy("in", root * count, "out", 0, count))
    s.add(*(Send(i, "in", i * count, count) for i in range(world) if i != root))
    return s


def terms(world: int, n: float) -> Terms:
    """alpha + n(P-1) beta at the root, whose link carries every block; n = one rank's block."""
    return Terms(int(world > 1), n * (world - 1), 0)


def copied(world: int, n: float) -> float:
    """The root's own block: n."""
    return n


cost = cost_of(terms, copied, block=True)
