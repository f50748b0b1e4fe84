"""Binomial-tree broadcast on "out", from ``root``.

Ranks are renumbered relative to the root, v = (rank - root) % P. Rank v receives the whole
buffer from its parent v - lowbit(v), then sends it to its children v + m for each power of
two m below lowbit(v) (all powers below P for the root), farthest child first so that the
largest subtree starts earliest. Round k doubles the number of ranks holding the data.

Steps: ceil(log2 P) rounds. Bytes sent per rank: n per child, up to n*ceil(log2 P) at the
root; the world moves n*(P-1). Cost: ceil(log2 P)*(alpha + n*beta). The cheapest for
small and medium messages, always at P = 2; for large ones scatter_allgather's ~2n*beta wins.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, clog2, cost_of, no_copies
from pycoll.algorithms.schedule import (
    Recv,
    Schedule,
    Send,
    binomial_children,
    binomial_parent,
)


def schedule(rank: int, world: int, count: int, root: int) -> Schedule:
    s = Schedule("binomial_broadcast", rank, world)
    v = (rank - root) % world
    parent = binomial_parent(v)
    if parent is not None:
        s.add(Recv((parent + root) % world, "out", 0, count))
    for child in reversed(binomial_children(v, world)):
        s.add(Send((child + root) % world, "out", 0, count))
    return s


def terms(world: int, n: float) -> Terms:
    """ceil(log2 P)(alpha + n beta)."""
    c = clog2(world)
    return Terms(c, c * n, 0)


copied = no_copies  # nothing is copied locally
cost = cost_of(terms, copied)
