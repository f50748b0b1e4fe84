"""Halving-doubling all-reduce (Rabenseifner): recursive-halving reduce-scatter, then
recursive-doubling all-gather, in place on "out"; for large messages on any world size.

With P a power of two the buffer is cut into P blocks (sizes within one element). Reduce-
scatter: in round k (mask = P/2, P/4, ..., 1) rank r pairs with r XOR mask, splits the
range of blocks it still owns in half, sends the half its partner keeps (the upper half if
r's mask bit is 0, else the lower) and receive-reduces the half it keeps. After log2(P)
rounds rank r owns the full reduction of block r. All-gather runs the rounds backwards
(mask = 1, 2, ..., P/2): send the aligned group of blocks r owns, receive the partner's.

Each element's final value is computed on exactly one rank and then copied, so results are
bitwise identical on all ranks. Receive-reduce writes only the kept half while the other
half is sent, so no temp is needed (the executor's per-segment scratch does the rest).

Any other P uses the MPICH fold (``schedule.fold_rank``): even ranks r < 2*rem first send
their whole buffer to r+1 and at the end receive the result from it.

Steps: 2*log2(p) (+2 with the fold). Bytes sent per active rank: 2*n*(p-1)/p (+n for the
fold). Cost: 2*log2(p)*alpha + 2*n*(p-1)/p*beta + n*(p-1)/p*gamma. Same bytes as
ring in fewer rounds (log p instead of P-1) on powers of two, where the tuner takes it over
ring for large messages; off powers of two the fold's extra n makes ring cheaper.
"""

from __future__ import annotations

from pycoll.algorithms.cost import Terms, cost_of, fold, fold_busy, no_copies
from pycoll.algorithms.schedule import (
    Recv,
    RecvReduce,
    Schedule,
    Send,
    chunks,
    fold_in,
    fold_out,
    pow2_floor,
    unfold_rank,
)


def schedule(rank: int, world: int, count: int) -> Schedule:
    s = Schedule("halving_doubling_allreduce", rank, world)
    p = pow2_floor(world)
    new = fold_in(s, rank, world, count)
    if new is not None and p > 1:
        c = chunks(count, p)

        def span(lo: int, hi: int) -> tuple[int, int]:  # blocks [lo, hi) -> (start, count)
            return c[lo][0], c[hi - 1][0] + c[hi - 1][1] - c[lo][0]

        lo, hi, mask = 0, p, p >> 1
        while mask:  # reduce-scatter by recursive halving
            peer, mid = unfold_rank(new ^ mask, world), (lo + hi) // 2
            if new & mask:
                give, lo = (lo, mid), mid
            else:
                give, hi = (mid, hi), mid
            s.add(Send(peer, "out", *span(*give)), RecvReduce(peer, "out", *span(lo, hi)))
            mask >>= 1
        mask = 1
        while mask < p:  # all-gather by recursive doubling
            peer = unfold_rank(new ^ mask, world)
            other = (lo + mask, hi + mask) if not new & mask else (lo - mask, hi - mask)
            s.add(Send(peer, "out", *span(lo, hi)), Recv(peer, "out", *span(*other)))
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1
    fold_out(s, rank, world, count, new)
    return s


def terms(world: int, n: float) -> Terms:
    """2 log2 p alpha + 2n(p-1)/p beta + n(p-1)/p gamma (+ 2(alpha + n beta) + n gamma fold)."""
    p, f, k = fold(world)
    return Terms(2 * k + 2 * f, 2 * n * (p - 1) / p + 2 * f * n, n * (p - 1) / p + f * n)


copied = no_copies  # nothing is copied locally
busy = fold_busy  # the fold leaves the others idle in the main rounds
cost = cost_of(terms, copied)
