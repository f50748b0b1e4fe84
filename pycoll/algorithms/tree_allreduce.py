"""Tree all-reduce: binomial-tree reduce to rank 0, then binomial-tree broadcast from it.

Reduce: rank v receive-reduces from its children v+1, v+2, v+4, ... (those below v's lowest
set bit), nearest first, then sends its partial result to its parent v - lowbit(v). Rank 0
ends with the full reduction and broadcasts it down the same tree, farthest child first.
The result is computed on rank 0 only and copied, so it is bitwise identical everywhere.
Everything is in place on "out"; no temps.

Steps: 2*ceil(log2 P) rounds. Bytes sent per rank: up to n*ceil(log2 P) (rank 0 in the
broadcast), n for a leaf. Cost: 2*ceil(log2 P)*(alpha + n*beta) + ceil(log2 P)*n*gamma.
Simple and latency-friendly but not bandwidth-optimal: for teaching, or small messages
where recursive doubling's temp is unwelcome.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, clog2, cost_of, no_copies
from pycoll.algorithms.schedule import (
    Recv,
    RecvReduce,
    Schedule,
    Send,
    binomial_children,
    binomial_parent,
)


def schedule(rank: int, world: int, count: int) -> Schedule:
    s = Schedule("tree_allreduce", rank, world)
    kids, parent = binomial_children(rank, world), binomial_parent(rank)
    for child in kids:
        s.add(RecvReduce(child, "out", 0, count))
    if parent is not None:
        s.add(Send(parent, "out", 0, count))
        s.add(Recv(parent, "out", 0, count))
    for child in reversed(kids):
        s.add(Send(child, "out", 0, count))
    return s


def terms(world: int, n: float) -> Terms:
    """2 ceil(log2 P)(alpha + n beta) + ceil(log2 P) n gamma (an upper bound off powers of two)."""
    c = clog2(world)
    return Terms(2 * c, 2 * c * n, c * n)


copied = no_copies  # nothing is copied locally
cost = cost_of(terms, copied)
