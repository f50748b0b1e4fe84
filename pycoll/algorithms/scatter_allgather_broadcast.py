"""Scatter-allgather broadcast (van de Geijn) on "out", from ``root``; for large messages.

The buffer is cut into P blocks (sizes within one element); block j belongs to relative
rank j = (rank - root) % P. Scatter: down the binomial tree (as binomial_broadcast), each
rank v receives from its parent only the blocks of its own subtree [v, v + lowbit(v)), and
passes each child c the blocks of c's subtree. Then a ring all-gather over relative ranks:
in step s (0..P-2) rank v sends block (v-s) to v+1 and receives block (v-s-1) from v-1.
Blocks are contiguous in relative-rank order, so every transfer is one contiguous range.

Steps: ceil(log2 P) + P - 1. Bytes sent per rank: about n*(P-1)/P in the all-gather plus
its share of the scatter (n*(P-1)/P at the root); about 2n in total at the root instead of
n*log2 P. Cost: (log2 P + P - 1)*alpha + 2*n*(P-1)/P*beta. Cheaper than binomial
for large messages at P >= 3 (the crossover grows with alpha/beta).
"""

from __future__ import annotations

from pycoll.algorithms.cost import ZERO, Terms, clog2, cost_of, no_copies
from pycoll.algorithms.schedule import (
    Recv,
    Schedule,
    Send,
    binomial_children,
    binomial_parent,
    chunks,
    subtree,
)


def schedule(rank: int, world: int, count: int, root: int) -> Schedule:
    s = Schedule("scatter_allgather_broadcast", rank, world)
    if world == 1:
        return s
    c = chunks(count, world)
    v = (rank - root) % world

    def blocks(lo: int, hi: int) -> tuple[int, int]:  # relative blocks [lo, hi) -> (start, count)
        return c[lo][0], c[hi - 1][0] + c[hi - 1][1] - c[lo][0]

    def real(u: int) -> int:
        return (u + root) % world

    parent = binomial_parent(v)
    if parent is not None:
        s.add(Recv(real(parent), "out", *blocks(*subtree(v, world))))
    for child in reversed(binomial_children(v, world)):
        s.add(Send(real(child), "out", *blocks(*subtree(child, world))))
    for step in range(world - 1):
        s.add(Send(real(v + 1), "out", *c[(v - step) % world]),
              Recv(real(v - 1), "out", *c[(v - step - 1) % world]))
    return s


def terms(world: int, n: float) -> Terms:
    """(ceil(log2 P) + P-1) alpha + 2n(P-1)/P beta."""
    P = world
    return ZERO if P < 2 else Terms(clog2(P) + P - 1, 2 * n * (P - 1) / P, 0)


copied = no_copies  # nothing is copied locally
cost = cost_of(terms, copied)
