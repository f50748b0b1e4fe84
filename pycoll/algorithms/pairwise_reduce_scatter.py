"""Pairwise reduce-scatter with uneven blocks; for small messages, no temps.

Layout as ring_reduce_scatter. Rank r copies its own "in" block r into "out", then in step
k (1..P-1) sends its block (r+k) to rank r+k and receive-reduces block r from rank r-k.
Each rank reduces all P contributions to its block itself, in the fixed order r, r-1, ...

Steps: P-1 (+1 local copy). Bytes sent per rank: sum(counts) - counts[r], n*(P-1)/P for
even blocks. Cost: (P-1)*alpha + n*(P-1)/P*(beta + gamma). No dependency chain between
steps, no temp, and one block copied (ring copies P-1): the cheaper of the two from P = 3.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of
from pycoll.algorithms.schedule import Copy, RecvReduce, Schedule, Send, displacements


def schedule(rank: int, world: int, counts: list[int]) -> Schedule:
    s = Schedule("pairwise_reduce_scatter", rank, world)
    disp = displacements(counts)
    s.add(Copy("in", disp[rank], "out", 0, counts[rank]))
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        s.add(Send(dst, "in", disp[dst], counts[dst]), RecvReduce(src, "out", 0, counts[rank]))
    return s


def terms(world: int, n: float) -> Terms:
    """(P-1) alpha + n(P-1)/P (beta + gamma), n = the whole input."""
    P = world
    return Terms(P - 1, n * (P - 1) / P, n * (P - 1) / P)


def copied(world: int, n: float) -> float:
    """Its own block of "in" into "out": n/P."""
    return n / world


cost = cost_of(terms, copied)
