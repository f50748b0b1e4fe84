"""Dissemination barrier: in round k (distance d = 2^k < P) rank r sends an empty message to
r+d and waits for one from r-d. After ceil(log2 P) rounds every rank has (transitively)
heard from every other, so no rank leaves before all have entered.

Messages carry no payload (buffer "out", start 0, count 0), only headers, which also lets
ranks detect a peer that called a different collective.

Steps: ceil(log2 P). Bytes sent per rank: 0 (headers only). Cost: ceil(log2 P)*alpha.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, clog2, cost_of, no_copies
from pycoll.algorithms.schedule import Recv, Schedule, Send


def schedule(rank: int, world: int) -> Schedule:
    s = Schedule("dissemination_barrier", rank, world)
    d = 1
    while d < world:
        s.add(Send((rank + d) % world, "out", 0, 0), Recv((rank - d) % world, "out", 0, 0))
        d <<= 1
    return s


def terms(world: int, n: float = 0) -> Terms:
    """ceil(log2 P) alpha (headers only)."""
    return Terms(clog2(world), 0, 0)


copied = no_copies  # nothing is copied locally
cost = cost_of(terms, copied)
