"""Recursive-doubling all-reduce: log2(P) whole-buffer exchanges, for small messages.

With P a power of two, in round k (k = 0..log2(P)-1) rank r exchanges its whole buffer with
partner r XOR 2^k and reduces, so after round k every rank holds the reduction over its
aligned group of 2^(k+1) ranks; after the last, over the world. Both partners compute
``lower op upper`` with the lower group's data on the left: IEEE a+b == b+a, but torch's
kernels are not always bitwise commutative (complex multiplication differs in the last bit
between its vector and scalar paths), so a fixed operand order is what makes all ranks end
with bitwise-identical results. The lower partner reduces the received buffer into its
own; the upper one reduces its own into the received one, and the two buffers swap roles
("out" and a temp of ``count``); a final local copy moves the result to "out" if needed.

Any other P uses the MPICH fold (see ``schedule.fold_rank``): with p = pow2_floor(P) and
rem = P - p, each even rank r < 2*rem first sends its buffer to r+1, which reduces it in;
the p active ranks run the rounds above; finally each odd rank r < 2*rem sends the result
back to r-1 (a copy, so the folded ranks are bitwise identical too).

"out" is sent while the partner's buffer arrives, so it cannot be received into "out".

Steps: log2(p) exchanges (+2 with the fold). Bytes sent per active rank: n*log2(p) (+n for
the ranks in the fold). Cost: log2(p)*(alpha + n*beta + n*gamma) (+2*(alpha + n*beta)).
Local copies: n (the final copy out of the temp). Latency-optimal: the cheapest for small
messages.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of, fold, fold_busy
from pycoll.algorithms.schedule import (
    Copy,
    Recv,
    Reduce,
    Schedule,
    Send,
    fold_in,
    fold_out,
    pow2_floor,
    unfold_rank,
)


def schedule(rank: int, world: int, count: int) -> Schedule:
    s = Schedule("recursive_doubling_allreduce", rank, world)
    p = pow2_floor(world)
    new = fold_in(s, rank, world, count)
    if new is not None and p > 1:
        s.temps["tmp"] = count
        mine, other, mask = "out", "tmp", 1
        while mask < p:
            peer = unfold_rank(new ^ mask, world)
            s.add(Send(peer, mine, 0, count), Recv(peer, other, 0, count))
            if new & mask:  # upper partner: result = received op mine, in the received buffer
                s.add(Reduce(mine, 0, other, 0, count))
                mine, other = other, mine
            else:
                s.add(Reduce(other, 0, mine, 0, count))
            mask <<= 1
        if mine != "out":
            s.add(Copy(mine, 0, "out", 0, count))
    fold_out(s, rank, world, count, new)
    return s


def terms(world: int, n: float) -> Terms:
    """log2 p (alpha + n beta + n gamma) (+ 2(alpha + n beta) + n gamma with the fold)."""
    _, f, k = fold(world)
    return Terms(k + 2 * f, k * n + 2 * f * n, k * n + f * n)


def copied(world: int, n: float) -> float:
    """The ranks whose result ends in the temp copy it to "out": n."""
    return n if world > 1 else 0.0


busy = fold_busy  # the fold leaves the others idle in the main rounds
cost = cost_of(terms, copied)
