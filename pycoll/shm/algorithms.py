"""Collectives of the ranks of one host, directly in shared memory.

Every collective runs in rounds over the double-buffered staging slots of an ``ShmArena``
(a round moves at most one slot of data per rank, so a 1 GiB tensor needs no 1 GiB of
/dev/shm). The one rule that makes two slot halves enough: a rank reads the slots of round
k only between round k's first barrier and its own next barrier, and writes a slot half
only after a barrier of the round before; so no write can overtake a peer's read.

- all_reduce, small (``one_shot_bytes``: 64 KiB, 1 MiB for two ranks): each rank writes its
  input, one barrier, each rank reduces all inputs in rank order (bitwise the same result
  everywhere). 1 barrier a round.
- all_reduce, two ranks, larger: each stages the half its peer reduces, reduces its own half
  into its output, publishes it, copies the peer's half out: half the reduction work of the
  one-shot form and 4.5 bytes moved per byte against 5; rounds pipelined (a round's staging
  with the round before's reduction), R rounds in R + 1 barriers.
- all_reduce, large: write input, barrier, rank r reduces slice r of every input in place
  in its own slot (an in-memory reduce-scatter), barrier, every rank copies all reduced
  slices out (an in-memory all-gather). 2 barriers a round; each rank reads ~2n bytes.
- reduce: as large all_reduce, only the root copies out.
- broadcast / scatter: the root writes, barrier, the others copy out.
- all_gather / gather: each writes, barrier, each (or the root) copies all out.
- reduce_scatter: each rank writes block q of its input into region q of its slot, barrier,
  rank r reduces region r of every slot into its output.
- all_to_all: each rank writes block q into region q of its slot, barrier, rank r copies
  region r of every slot.
- barrier: a barrier.

The first barrier of every collective also checks that all local ranks published the same
signature (collective, sequence number, dtype, size, op, root), so a mismatch is an error
on every rank, never a hang or a wrong result.
"""

from __future__ import annotations

import numpy as np
import torch

from pycoll.algorithms.schedule import chunks, displacements
from pycoll.core import kernels
from pycoll.core.kernels import copy
from pycoll.core.reductions import Reduction
from pycoll.shm.rounds import (
    ONE_SHOT_BYTES,
    Barriers,
    one_shot_bytes,
    rounds,
)
from pycoll.errors import MismatchError
from pycoll.shm.arena import ShmArena

# Two-rank all_reduce rounds of 1 MiB rather than the whole 4 MiB slot: a round that stays
# in the caches beats one that streams through memory (measured: docs/performance.md,
# "Shared-memory round size").
PAIR_ROUND_BYTES = 1 << 20
_FLOAT16 = torch.float16   # (a module global: read on every small all_reduce)
# numpy computes float16 in software (230 us against torch's 5 us at 32768 elements): the
# numpy round reduces float16 only up to this many elements.
_NP_FLOAT16_MAX = 128


def _numpy_reduces(red: Reduction, n: int, dtype: torch.dtype) -> bool:
    """Whether a small round reduces ``n`` elements of ``dtype`` with ``red`` in numpy (a small
    message's cost is call overhead, and numpy's is a third of torch's): numpy has the op,
    and for float16 the message is short."""
    return red.ufunc is not None and (n <= _NP_FLOAT16_MAX or dtype is not _FLOAT16)


def all_reduce(arena: ShmArena, t: torch.Tensor, red: Reduction, words, deadline: float, what: str) -> None:
    if is_small_all_reduce(arena, t, red):
        return small_all_reduce(arena, t, red, words, deadline, what)
    n, dt = t.numel(), t.dtype
    barrier = Barriers(arena, words, deadline, what)
    L, me = arena.size, arena.me
    if L == 2 and n * dt.itemsize > min(one_shot_bytes(L), arena.slot_bytes):
        return _all_reduce_pair(arena, t, red, barrier)
    if L <= 2 or n * dt.itemsize <= min(ONE_SHOT_BYTES, arena.slot_bytes):
        # One-shot rounds (small messages without a numpy kernel, or one rank): every rank
        # reduces the whole round, in rank order, straight into its output; one barrier.
        for off, c in rounds(n, arena.slot_bytes // dt.itemsize):
            p = arena.next_parity()
            slots = [arena.slot(q, p, dt)[:c] for q in range(L)]
            copy(slots[me], t[off:off + c])
            barrier()
            if L > 1:
                out = t[off:off + c]
                red.combine(slots[0], slots[1], out)
                for q in range(2, L):
                    red.reduce(out, slots[q])
        return
    for off, c in rounds(n, arena.slot_bytes // dt.itemsize):
        p = arena.next_parity()
        slots = [arena.slot(q, p, dt)[:c] for q in range(L)]
        copy(slots[me], t[off:off + c])
        barrier()
        bounds = chunks(c, L)
        lo, size = bounds[me]
        acc = slots[me][lo:lo + size]
        for q in range(L):
            if q != me:
                red.reduce(acc, slots[q][lo:lo + size])
        barrier()
        for q, (lo, size) in enumerate(bounds):
            copy(t[off + lo:off + lo + size], slots[q][lo:lo + size])


def is_small_all_reduce(arena: ShmArena, t: torch.Tensor, red: Reduction) -> bool:
    """Whether all_reduce of ``t`` takes the one-round numpy form (small_all_reduce)."""
    n, dt = t.numel(), t.dtype
    nbytes = n * dt.itemsize
    return _numpy_reduces(red, n, dt) and nbytes <= min(one_shot_bytes(arena.size), arena.slot_bytes)


def small_all_reduce(arena: ShmArena, t: torch.Tensor, red: Reduction, words, deadline: float,
                     what: str) -> None:
    """One round in numpy, for the calls that ``is_small_all_reduce`` accepts."""
    barrier = Barriers(arena, words, deadline, what)
    tn = kernels.numpy_at(t)
    # (Exactly one parity step per round: skipping one would let a rank overwrite a slot
    # half that a slower peer is still reading.)
    slots = arena.numpy_slots(arena.next_parity(), tn.dtype, t.numel())
    slots[arena.me][...] = tn     # (a third of np.copyto's cost)
    barrier()
    if len(slots) > 1:
        _np_reduce_in_order(red, slots, tn)


def _np_reduce_in_order(red: Reduction, parts, out: np.ndarray) -> None:
    """``out = parts[0] op parts[1] op ...`` (two parts at least), in rank order on every
    rank, so that every rank's result is bitwise the same."""
    red.np_combine(parts[0], parts[1], out)
    for part in parts[2:]:
        red.np_combine(out, part, out)


def _all_reduce_pair(arena: ShmArena, t: torch.Tensor, red: Reduction, barrier) -> None:
    """Two ranks, large: each stages only the half its peer reduces, reduces its own half
    straight into its output (``x0 op x1`` in rank order), publishes it in the unused half of
    its slot, and copies the peer's reduced half out. Per rank and element: 4.5 bytes moved
    per byte of data against the one-shot form's 5.

    Rounds are pipelined: a round's staging goes with the reduction of the round before,
    into the other slot half, so R rounds take R + 1 barriers instead of 2R. (The peer read
    that slot half's staged region two rounds back, before the barrier that precedes the
    staging; what it reads of that slot half in the same step, the published region, is not
    the staged one.) A barrier costs a scheduling delay once a peer may wait for a core, so
    on a busy machine the barriers are much of what a large all_reduce costs.

    Where numpy loops over the dtype, the schedule runs on numpy views made once per call
    (a tensor-to-numpy conversion in every copy and reduce cost ~20 us a round).

    Rounds stop at PAIR_ROUND_BYTES however large the slot: a round's input, slot and the
    peer's slot then stay in cache between its copy, reduce and copy-out."""
    me, dt = arena.me, t.dtype
    if red.numpy_loops:
        buf = kernels.as_numpy(t)
        slots, put, combine = (lambda p: arena.numpy_slots(p, buf.dtype)), np.copyto, red.np_combine
    else:
        buf = t
        slots, put, combine = (lambda p: (arena.slot(0, p, dt), arena.slot(1, p, dt))), copy, red.combine

    # Each half has a fixed place in a slot, whatever the round's size (half h of a round at
    # h * half): a short last round's staging then cannot reach the published half of the
    # round two back, which the peer may be copying out at the same time.
    cap = min(arena.slot_bytes, PAIR_ROUND_BYTES) // dt.itemsize // 2 * 2
    half = cap // 2
    at_m, at_p = me * half, (1 - me) * half

    def stage(off: int, c: int):
        """Start a round: stage the half the peer reduces; the round's views."""
        both = slots(arena.next_parity())
        halves = chunks(c, 2)
        (lo_m, n_m), (lo_p, n_p) = halves[me], halves[1 - me]
        put(both[me][at_p:at_p + n_p], buf[off + lo_p:off + lo_p + n_p])
        return off, both[me], both[1 - me], lo_m, n_m, lo_p, n_p

    first, *later = rounds(t.numel(), cap)
    staged = stage(*first)
    barrier()
    for nxt in later + [None]:
        off, mine, peer, lo_m, n_m, lo_p, n_p = staged
        out, theirs = buf[off + lo_m:off + lo_m + n_m], peer[at_m:at_m + n_m]
        combine(*((out, theirs) if me == 0 else (theirs, out)), out)
        put(mine[at_m:at_m + n_m], out)
        if nxt is not None:
            staged = stage(*nxt)
        barrier()
        put(buf[off + lo_p:off + lo_p + n_p], peer[at_p:at_p + n_p])


def reduce(arena: ShmArena, src: torch.Tensor, out: torch.Tensor | None, root: int, red: Reduction,
           words, deadline: float, what: str) -> None:
    """``src`` is this rank's contribution; the root's result goes to ``out``."""
    L, me, dt = arena.size, arena.me, src.dtype
    barrier = Barriers(arena, words, deadline, what)
    for off, c in rounds(src.numel(), arena.slot_bytes // dt.itemsize):
        p = arena.next_parity()
        slots = [arena.slot(q, p, dt)[:c] for q in range(L)]
        copy(slots[me], src[off:off + c])
        barrier()
        bounds = chunks(c, L)
        lo, size = bounds[me]
        for q in range(L):
            if q != me:
                red.reduce(slots[me][lo:lo + size], slots[q][lo:lo + size])
        barrier()
        if me == root:
            for q, (lo, size) in enumerate(bounds):
                copy(out[off + lo:off + lo + size], slots[q][lo:lo + size])


def broadcast(arena: ShmArena, t: torch.Tensor, root: int, words, deadline: float, what: str) -> None:
    barrier = Barriers(arena, words, deadline, what)
    for off, c in rounds(t.numel(), arena.slot_bytes // t.dtype.itemsize):
        p = arena.next_parity()
        slot = arena.slot(root, p, t.dtype)[:c]
        if arena.me == root:
            copy(slot, t[off:off + c])
        barrier()
        if arena.me != root:
            copy(t[off:off + c], slot)


def all_gather(arena: ShmArena, out: torch.Tensor | None, inp: torch.Tensor, root: int, words,
               deadline: float, what: str) -> None:
    """All-gather (``root`` < 0) or gather to ``root``: block q of ``out`` is rank q's input."""
    L, me, dt, n = arena.size, arena.me, inp.dtype, inp.numel()
    barrier = Barriers(arena, words, deadline, what)
    nbytes = n * dt.itemsize
    if nbytes <= ONE_SHOT_BYTES and nbytes <= arena.slot_bytes and dt in kernels.NUMPY_VIEWABLE:
        # One round in numpy, as small_all_reduce: four torch slices and copies a peer cost
        # more than the data.
        src = kernels.numpy_at(inp)
        slots = arena.numpy_slots(arena.next_parity(), src.dtype, n)
        slots[me][...] = src
        barrier()
        if root < 0 or me == root:
            dst = kernels.numpy_at(out)
            for q in range(L):
                dst[q * n:(q + 1) * n] = slots[q]
        return
    for off, c in rounds(n, arena.slot_bytes // dt.itemsize):
        p = arena.next_parity()
        copy(arena.slot(me, p, dt)[:c], inp[off:off + c])
        barrier()
        if root < 0 or me == root:
            for q in range(L):
                copy(out[q * n + off:q * n + off + c], arena.slot(q, p, dt)[:c])


def scatter(arena: ShmArena, out: torch.Tensor, inp: torch.Tensor | None, root: int, words,
            deadline: float, what: str) -> None:
    L, me, dt, n = arena.size, arena.me, out.dtype, out.numel()
    barrier = Barriers(arena, words, deadline, what)
    region = arena.slot_bytes // dt.itemsize // L
    for off, c in rounds(n, region):
        p = arena.next_parity()
        slot = arena.slot(root, p, dt)
        if me == root:
            for q in range(L):
                copy(slot[q * region:q * region + c], inp[q * n + off:q * n + off + c])
        barrier()
        copy(out[off:off + c], slot[me * region:me * region + c])


def reduce_scatter(arena: ShmArena, out: torch.Tensor, inp: torch.Tensor, counts: tuple[int, ...],
                   red: Reduction, words, deadline: float, what: str) -> None:
    L, me, dt = arena.size, arena.me, inp.dtype
    barrier = Barriers(arena, words, deadline, what)
    region = arena.slot_bytes // dt.itemsize // L
    disp = displacements(list(counts))
    c = counts[me]
    if (_numpy_reduces(red, c, dt) and inp.numel() * dt.itemsize <= ONE_SHOT_BYTES and max(counts) <= region
            and dt in kernels.NUMPY_VIEWABLE):
        # One round in numpy, as small_all_reduce (and in the same rank order).
        src = kernels.numpy_at(inp)
        slots = arena.numpy_slots(arena.next_parity(), src.dtype)
        for q in range(L):
            slots[me][q * region:q * region + counts[q]] = src[disp[q]:disp[q] + counts[q]]
        barrier()
        dst, lo = kernels.numpy_at(out), me * region
        parts = [s[lo:lo + c] for s in slots]
        if L == 1:
            dst[...] = parts[0]
        else:
            _np_reduce_in_order(red, parts, dst)
        return
    for off, _ in rounds(max(counts, default=0), region):
        p = arena.next_parity()
        mine = arena.slot(me, p, dt)
        for q in range(L):
            c = max(0, min(region, counts[q] - off))
            copy(mine[q * region:q * region + c], inp[disp[q] + off:disp[q] + off + c])
        barrier()
        c = max(0, min(region, counts[me] - off))
        seg = out[off:off + c]
        copy(seg, arena.slot(0, p, dt)[me * region:me * region + c])
        for q in range(1, L):
            red.reduce(seg, arena.slot(q, p, dt)[me * region:me * region + c])


def all_to_all(arena: ShmArena, out: torch.Tensor, inp: torch.Tensor, send_counts: tuple[int, ...],
               recv_counts: tuple[int, ...], words, deadline: float, what: str) -> None:
    L, me, dt = arena.size, arena.me, inp.dtype
    barrier = Barriers(arena, words, deadline, what)
    # Word 7 (not compared) carries each rank's largest block: all ranks need the global
    # maximum to agree on the number of rounds.
    arena.publish(words + (max(send_counts, default=0),), new_op=False)
    # The first round's slot starts with every rank's send counts, so that each rank checks
    # what its peers send it against what it expects: split sizes are per rank, so no
    # signature word can hold them, and a disagreement must not pass as stale data.
    head = -(-8 * L // 64) * 64
    region = (arena.slot_bytes - head) // dt.itemsize // L
    sdisp, rdisp = displacements(list(send_counts)), displacements(list(recv_counts))
    off, rounds = 0, 1
    while off == 0 or off < rounds * region:
        p = arena.next_parity()
        mine = arena.slot(me, p)[head:].view(dt)
        if off == 0:
            arena.slot(me, p)[:8 * L].view(torch.int64).copy_(torch.tensor(send_counts, dtype=torch.int64))
        for q in range(L):
            c = max(0, min(region, send_counts[q] - off))
            copy(mine[q * region:q * region + c], inp[sdisp[q] + off:sdisp[q] + off + c])
        barrier()
        if off == 0:
            _check_split_sizes(arena, p, recv_counts, what)
            gmax = max(arena.peer_word(q, 7) for q in range(L))
            rounds = max(1, -(-gmax // region))
        for q in range(L):
            c = max(0, min(region, recv_counts[q] - off))
            copy(out[rdisp[q] + off:rdisp[q] + off + c], arena.slot(q, p)[head:].view(dt)[me * region:me * region + c])
        off += region


def _check_split_sizes(arena: ShmArena, parity: int, recv_counts: tuple[int, ...], what: str) -> None:
    """Each peer's published send count to this rank must be what this rank expects."""
    L, me = arena.size, arena.me
    for q in range(L):
        sent = int(arena.slot(q, parity)[8 * me:8 * me + 8].view(torch.int64))
        if sent != recv_counts[q]:
            raise MismatchError(
                f"{what}: split sizes disagree: rank {arena.ranks[q]} sends {sent} elements to rank "
                f"{arena.ranks[me]}, which expects {recv_counts[q]} from it", rank=arena.ranks[me],
                peer=arena.ranks[q])


def barrier(arena: ShmArena, words, deadline: float, what: str) -> None:
    Barriers(arena, words, deadline, what)()
