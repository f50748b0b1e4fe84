"""Binomial-tree reduce to ``root``: the root accumulates in place into "out".

Relative ranks v = (rank - root) % P form a binomial tree (parent v - lowbit(v)). Rank v
receive-reduces its children v+1, v+2, v+4, ... nearest first, then sends the partial
result to its parent. Non-root ranks read their contribution from "in" and never write it:
a leaf sends "in" directly; an inner rank first copies "in" to a temp of ``count`` elements
and accumulates its children there. The root's "out" already holds its contribution.

Steps: ceil(log2 P) rounds (+1 local copy on inner ranks). Bytes sent per rank: n (each
non-root sends once). Cost: ceil(log2 P)*(alpha + n*beta + n*gamma). Good for small and
medium messages; for large ones reduce-scatter + gather moves less per link.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, clog2, cost_of
from pycoll.algorithms.schedule import (
    Copy,
    RecvReduce,
    Schedule,
    Send,
    binomial_children,
    binomial_parent,
)


def schedule(rank: int, world: int, count: int, root: int) -> Schedule:
    s = Schedule("binomial_reduce", rank, world)
    v = (rank - root) % world
    kids, parent = binomial_children(v, world), binomial_parent(v)
    acc = "out" if parent is None else "in"
    if kids and parent is not None:
        s.temps["tmp"] = count
        s.add(Copy("in", 0, "tmp", 0, count))
        acc = "tmp"
    for child in kids:
        s.add(RecvReduce((child + root) % world, acc, 0, count))
    if parent is not None:
        s.add(Send((parent + root) % world, acc, 0, count))
    return s


def terms(world: int, n: float) -> Terms:
    """ceil(log2 P)(alpha + n beta + n gamma)."""
    c = clog2(world)
    return Terms(c, c * n, c * n)


def copied(world: int, n: float) -> float:
    """Inner non-root ranks (there are some from P = 4) copy "in" to their temp: n."""
    return n if world >= 4 else 0.0


cost = cost_of(terms, copied)
