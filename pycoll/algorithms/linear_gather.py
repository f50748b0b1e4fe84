"""Linear gather to ``root``: "in" holds ``count`` elements; the root's "out" gets world*count,
rank i's block at i*count.

Every non-root rank sends "in" to the root in one step; the root copies its own block and
receives all P-1 others in one step (the transport runs them concurrently).

Steps: 1. Bytes sent per non-root rank: n (= count); the root receives n*(P-1). Cost:
alpha + n*(P-1)*beta at the root's link. The one gather algorithm.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of
from pycoll.algorithms.schedule import Copy, Recv, Schedule, Send


def schedule(rank: int, world: int, count: int, root: int) -> Schedule:
    s = Schedule("linear_gather", rank, world)
    if rank != root:
        s.add(Send(root, "in", 0, count))
        return s
    s.add(Copy("in", 0, "out", root * count, count))
    s.add(*(Recv(i, "out", i * count, count) for i in range(world) if i != root))
    return s


def terms(world: int, n: float) -> Terms:
    """alpha + n(P-1) beta at the root, whose link takes every block; n = one rank's block."""
    return Terms(int(world > 1), n * (world - 1), 0)


def copied(world: int, n: float) -> float:
    """The root's own block: n."""
    return n


cost = cost_of(terms, copied, block=True)
