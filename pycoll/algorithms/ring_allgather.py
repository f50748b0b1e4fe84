"""Ring all-gather: "in" holds ``count`` elements; "out" gets every rank's, rank r's at r*count.

Rank r first copies "in" into its own block of "out". In step s (0..P-2) it sends block
(r-s) to r+1 and receives block (r-s-1) from r-1, so each block travels once round the
ring and every link carries one block per step.

Steps: P-1 (+1 local copy). Bytes sent per rank: n*(P-1) where n = count (bandwidth-
optimal). Cost: (P-1)*(alpha + n*beta). The cheapest for large messages.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of
from pycoll.algorithms.schedule import Copy, Recv, Schedule, Send


def schedule(rank: int, world: int, count: int) -> Schedule:
    s = Schedule("ring_allgather", rank, world)
    s.add(Copy("in", 0, "out", rank * count, count))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_b, recv_b = (rank - step) % world, (rank - step - 1) % world
        s.add(Send(nxt, "out", send_b * count, count), Recv(prv, "out", recv_b * count, count))
    return s


def terms(world: int, n: float) -> Terms:
    """(P-1)(alpha + n beta), n = one rank's block."""
    return Terms(world - 1, n * (world - 1), 0)


def copied(world: int, n: float) -> float:
    """Its own block from "in" to "out": n."""
    return n


cost = cost_of(terms, copied, block=True)
