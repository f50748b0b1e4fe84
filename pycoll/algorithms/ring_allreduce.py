"""Ring all-reduce: a ring reduce-scatter followed by a ring all-gather, in place on "out".

The buffer is cut into P chunks (sizes within one element of each other). In reduce-scatter
step s (0..P-2) rank r sends chunk (r-s) to r+1 and reduces chunk (r-s-1) received from
r-1; afterwards rank r holds the full reduction of chunk (r+1). In all-gather step s rank r
sends chunk (r+1-s) to r+1 and receives chunk (r-s) from r-1.

Steps: 2(P-1). Bytes sent per rank: 2(P-1)/P * n (bandwidth-optimal). Latency: 2(P-1) alpha.
Each step is executed in segments (the executor's pipeline unit), so temporary memory is
one segment, not one chunk.
"""

from __future__ import annotations

from pycoll.algorithms.cost import ZERO, Terms, cost_of, no_copies
from pycoll.algorithms.schedule import Recv, RecvReduce, Schedule, Send, chunks


def schedule(rank: int, world: int, count: int) -> Schedule:
    s = Schedule("ring_allreduce", rank, world)
    if world == 1:
        return s
    c = chunks(count, world)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_c, recv_c = c[(rank - step) % world], c[(rank - step - 1) % world]
        s.add(Send(nxt, "out", *send_c), RecvReduce(prv, "out", *recv_c))
    for step in range(world - 1):
        send_c, recv_c = c[(rank + 1 - step) % world], c[(rank - step) % world]
        s.add(Send(nxt, "out", *send_c), Recv(prv, "out", *recv_c))
    return s


def terms(world: int, n: float) -> Terms:
    """2(P-1) alpha + 2n(P-1)/P beta + n(P-1)/P gamma."""
    P = world
    return ZERO if P < 2 else Terms(2 * (P - 1), 2 * n * (P - 1) / P, n * (P - 1) / P)


copied = no_copies  # nothing is copied locally
cost = cost_of(terms, copied)
