"""Pairwise all-to-all with uneven blocks (zeros allowed).

"in" holds sum(send_counts) in destination-rank blocks, "out" sum(recv_counts) in source-
rank blocks (prefix-sum displacements). Step 0 copies rank r's block for itself locally;
in step k (1..P-1) rank r sends its block for r+k to r+k and receives r-k's block for it.
Each step pairs every rank with one sender and one receiver, so no link is oversubscribed.

Steps: P-1 (+1 local copy). Bytes sent per rank: sum(send_counts) - send_counts[r]. Cost:
(P-1)*alpha + n*(P-1)/P*beta for even blocks of a total n. The one all-to-all algorithm.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of
from pycoll.algorithms.schedule import Copy, Recv, Schedule, Send, displacements


def schedule(rank: int, world: int, send_counts: list[int], recv_counts: list[int]) -> Schedule:
    if send_counts[rank] != recv_counts[rank]:
        raise ValueError(f"all_to_all: rank {rank} sends {send_counts[rank]} elements to itself "
                         f"but expects {recv_counts[rank]}")
    s = Schedule("pairwise_alltoall", rank, world)
    sd, rd = displacements(send_counts), displacements(recv_counts)
    s.add(Copy("in", sd[rank], "out", rd[rank], recv_counts[rank]))
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        s.add(Send(dst, "in", sd[dst], send_counts[dst]),
              Recv(src, "out", rd[src], recv_counts[src]))
    return s


def terms(world: int, n: float) -> Terms:
    """(P-1) alpha + n(P-1)/P beta, n = one rank's whole input (even blocks)."""
    P = world
    return Terms(P - 1, n * (P - 1) / P, 0)


def copied(world: int, n: float) -> float:
    """Its own block from "in" to "out": n/P."""
    return n / world


cost = cost_of(terms, copied)
