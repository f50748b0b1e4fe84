"""Ring reduce-scatter with uneven blocks: "in" holds sum(counts) in rank blocks (prefix-sum
displacements); rank r ends with the reduction of everyone's block r in "out" (counts[r]).

In step s (0..P-2) rank r sends its partial sum of block (r-s-1) to r+1 and receives the
partial sum of block (r-s-2) from r-1, reducing its own contribution in: before the step it
copies its "in" block into the destination, then receive-reduces into it. Step 0 sends
straight from "in"; the last step's destination is "out" (block r). In between, partial
sums alternate between two temps of max(counts) elements ("in" is never written). Each
block is reduced along one chain of ranks, so its result is computed in one fixed order.

Steps: P-1 (+P-1 local copies). Bytes sent per rank: sum of P-1 blocks, n*(P-1)/P for even
blocks of a total n. Cost: (P-1)*alpha + n*(P-1)/P*(beta + gamma). Bandwidth-optimal, as
pairwise, which copies less; at P = 2 they cost the same and ring, listed first, is taken.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of
from pycoll.algorithms.schedule import Copy, RecvReduce, Schedule, Send, displacements


def schedule(rank: int, world: int, counts: list[int]) -> Schedule:
    s = Schedule("ring_reduce_scatter", rank, world)
    disp = displacements(counts)
    if world > 2:
        s.temps["tmp0"] = max(counts)
    if world > 3:
        s.temps["tmp1"] = max(counts)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    src = "in"
    if world == 1:
        s.add(Copy("in", 0, "out", 0, counts[0]))
    for step in range(world - 1):
        send_b, recv_b = (rank - step - 1) % world, (rank - step - 2) % world
        dst = "out" if step == world - 2 else f"tmp{step % 2}"
        s.add(Copy("in", disp[recv_b], dst, 0, counts[recv_b]))
        s.add(Send(nxt, src, disp[send_b] if src == "in" else 0, counts[send_b]),
              RecvReduce(prv, dst, 0, counts[recv_b]))
        src = dst
    return s


def terms(world: int, n: float) -> Terms:
    """(P-1) alpha + n(P-1)/P (beta + gamma), n = the whole input."""
    P = world
    return Terms(P - 1, n * (P - 1) / P, n * (P - 1) / P)


def copied(world: int, n: float) -> float:
    """One block of "in" into each step's destination: n(P-1)/P (n at P = 1)."""
    return n if world == 1 else n * (world - 1) / world


cost = cost_of(terms, copied)
