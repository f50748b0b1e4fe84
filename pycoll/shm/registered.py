"""Collectives on registered memory (``pycoll.empty_shared``): in place, no staging.

When every local rank passes a tensor of the group's shared heap at the same offset
(``shm.heap``), each can read and write its peers' tensors directly, so
all_reduce needs no staging slot:

    barrier (every input is complete; the signatures, registration included, agree)
    rank r, for its 1/P slice, in pieces of PIECE_BYTES:
        acc = x0 op x1 op ... op x(P-1)   (rank order, into rank 0's or 1's copy)
        write acc into every other rank's copy
    barrier (every slice is everywhere)

A rank reads n bytes (its slice of P inputs) and writes n (its slice of P outputs): 2n of
memory traffic against 3.5n-5n for the staged forms, one copy's worth, the least any
all_reduce can move; and each slice is computed once, so the result is bitwise the same on
every rank. A piece stays in the cache between its reduction and its copies out. For
blocks allocated with ``unmap_peers`` (DDP's buckets), the peers' pages a rank touched are
unmapped piece by piece beyond a bound (``SharedHeap.unmapper``), so that they do not count
in its RSS as well as in theirs.

Agreement. Each rank puts its tensor's heap offset (+1; 0: not registered) in the extra
word of its all_reduce signature, so a rank with registered memory meeting one without (or
at another offset) is a ``MismatchError`` on every rank at the first barrier, before
anybody writes into a peer's memory. Only all_reduces over ``ONE_SHOT_BYTES`` look: below,
the one-round staged form (one barrier) is faster and never writes into peers' memory.

all_gather and reduce_scatter work the same way on the tensor that every rank's peers must
reach: all_gather_into_tensor's output (rank r writes its input into block r of every
rank's output: n bytes written a rank, against 2n staged) and reduce_scatter_tensor's input
(rank r reduces block r of every rank's input into its own output: n bytes read). The
extra word says where that tensor lies (all_gather: offset + 1; reduce_scatter: -(offset + 1),
as its unregistered form puts a non-negative hash of the counts there). FSDP2 allocates
exactly these two buffers through the group (``allocate_tensor``: ``c10d.shared``).

Allocation is itself a collective (``allocate``): its signature carries the size and the
offset each rank's heap will give, so ranks whose calls differ fail there, not later.
"""

from __future__ import annotations

import numpy as np
import torch

from pycoll import wire
from pycoll.algorithms.schedule import chunks
from pycoll.shm import algorithms as shm
from pycoll.core import kernels
from pycoll.core.kernels import copy
from pycoll.core.reductions import Reduction
from pycoll.shm.rounds import ONE_SHOT_BYTES, Barriers, counts_hash, describe_words, signature
from pycoll.errors import MismatchError
from pycoll.shm.arena import ShmArena
from pycoll.shm.heap import SharedHeap

PIECE_BYTES = 256 << 10     # a piece's P inputs stay in the caches (measured: docs/shm.md)
ALLOC_ROOT = -2             # the root word that marks an allocation's barrier signature
_ALL_REDUCE, _BARRIER = wire.OP_WORD["all_reduce"], wire.OP_WORD["barrier"]
_ALL_GATHER, _REDUCE_SCATTER = wire.OP_WORD["all_gather"], wire.OP_WORD["reduce_scatter"]


def describe(words: tuple[int, ...]) -> str:
    """``describe_words``, saying where a large all_reduce's tensor lives and naming allocations."""
    if words[0] == _BARRIER and words[5] == ALLOC_ROOT:
        return f"empty_shared(seq={words[1]}, nbytes={words[3]}, heap offset={words[6]})"
    text, sig = describe_words(words), wire.unpack(words)
    if words[0] == _ALL_REDUCE and sig is not None and wire.nbytes(sig) > ONE_SHOT_BYTES:
        text += f" on registered memory at heap offset {words[6] - 1}" if words[6] > 0 \
            else " on unregistered memory"
    elif words[0] in (_ALL_GATHER, _REDUCE_SCATTER) and sig is not None and wire.nbytes(sig) > ONE_SHOT_BYTES:
        where = words[6] if words[0] == _ALL_GATHER else -words[6]
        text += f" on registered memory at heap offset {where - 1}" if where > 0 \
            else " on unregistered memory"
    return text


def _explained(arena: ShmArena, words) -> None:
    """After a MismatchError: raise it again with every rank's registration described."""
    arena.check_signatures(words, describe)


def wants_lookup(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() > ONE_SHOT_BYTES


def all_reduce(arena: ShmArena, heap: SharedHeap | None, t: torch.Tensor, red: Reduction, seq: int,
               deadline: float) -> None:
    """all_reduce of flat ``t`` (larger than ONE_SHOT_BYTES) in place when it is registered,
    by the staged forms of ``shm.algorithms`` when not; applies ``red.finish`` either way."""
    what = f"all_reduce seq {seq}"
    block = heap.lookup(t.data_ptr(), t.nbytes) if heap is not None else None
    words = signature("all_reduce", seq, t.dtype, t.numel(), red.name,
                      extra=0 if block is None else 1 + block.global_offset)
    if block is None:
        try:
            shm.all_reduce(arena, t, red, words, deadline, what)
        except MismatchError:
            _explained(arena, words)
            raise
        red.finish(t)
        return
    _in_place(arena, words, deadline, what, lambda: _reduce_slice(arena.size, arena.me, heap, block, t, red))


def _reduce_slice(L: int, me: int, heap: SharedHeap, block, t: torch.Tensor, red: Reduction) -> None:
    """Reduce this rank's 1/L slice of every rank's copy and write it into all of them."""
    n, dt, nbytes = t.numel(), t.dtype, t.nbytes
    if L == 1:
        red.finish(t)
        return
    numpy = red.numpy_loops   # (its dtypes all have a numpy twin: kernels.NP_DTYPES)
    if numpy:
        bufs = heap.numpy_views(block, nbytes, kernels.NP_DTYPES[dt])
        combine, put = red.np_combine, np.copyto
    else:
        bufs = heap.tensor_views(block, nbytes, dt)
        combine, put = red.combine, copy
    lo, size = chunks(n, L)[me]
    isz = t.element_size()
    step = max(1, PIECE_BYTES // isz)
    unmap = heap.unmapper(block, size * isz)
    # The accumulator is rank 0's or rank 1's copy: x0 op x1 may overwrite either before
    # the others are added (rank me >= 2's own copy would be overwritten before it is read).
    into = me if me < 2 else 0
    for a in range(lo, lo + size, step):
        b = min(a + step, lo + size)
        parts = [buf[a:b] for buf in bufs]
        acc = parts[into]
        combine(parts[0], parts[1], acc)
        for q in range(2, L):
            combine(acc, parts[q], acc)
        if red.divisor != 1:
            red.finish(torch.from_numpy(acc) if numpy else acc)
        for q in range(L):
            if q != into:
                put(parts[q], acc)
        if unmap is not None:
            unmap(a * isz, b * isz)


def _in_place(arena: ShmArena, words, deadline: float, what: str, work) -> None:
    """barrier (signatures agree), ``work()`` on the peers' memory, barrier (all of it done)."""
    barrier = Barriers(arena, words, deadline, what)
    arena.next_parity()    # (one round, for the observers and the hang dump)
    try:
        barrier()
    except MismatchError:
        _explained(arena, words)
        raise
    work()
    barrier()


def all_gather(arena: ShmArena, heap: SharedHeap | None, out: torch.Tensor, inp: torch.Tensor, seq: int,
               deadline: float) -> None:
    """all_gather of flat ``inp`` (larger than ONE_SHOT_BYTES) into flat ``out``: written
    straight into every rank's ``out`` when it is registered, staged when not."""
    what = f"all_gather seq {seq}"
    block = heap.lookup(out.data_ptr(), out.nbytes) if heap is not None else None
    words = signature("all_gather", seq, inp.dtype, inp.numel(), extra=0 if block is None else 1 + block.global_offset)
    if block is None:
        try:
            shm.all_gather(arena, out, inp, -1, words, deadline, what)
        except MismatchError:
            _explained(arena, words)
            raise
        return
    L, me, dt, n = arena.size, arena.me, inp.dtype, inp.numel()
    outs = heap.tensor_views(block, out.nbytes, dt)
    # FSDP2 gathers in place (its input is block me of its output): that copy is no copy.
    targets = [q for q in range(L) if q != me or inp.data_ptr() != out.data_ptr() + me * inp.nbytes]
    step = max(1, PIECE_BYTES // dt.itemsize)
    unmap = heap.unmapper(block, inp.nbytes)

    def push() -> None:
        for a in range(0, n, step):   # a piece is read once and stays cached for its L copies
            b = min(a + step, n)
            for q in targets:
                copy(outs[q][me * n + a:me * n + b], inp[a:b])
            if unmap is not None:
                unmap((me * n + a) * dt.itemsize, (me * n + b) * dt.itemsize)

    _in_place(arena, words, deadline, what, push)


def reduce_scatter(arena: ShmArena, heap: SharedHeap | None, out: torch.Tensor, inp: torch.Tensor,
                   counts: tuple[int, ...], red: Reduction, seq: int, deadline: float) -> None:
    """reduce_scatter of flat ``inp`` (larger than ONE_SHOT_BYTES): block me of every rank's
    ``inp`` reduced straight into ``out`` when ``inp`` is registered and the blocks are
    equal (reduce_scatter_tensor), staged otherwise. The caller applies ``red.finish``."""
    what = f"reduce_scatter seq {seq}"
    equal = len(set(counts)) == 1
    block = heap.lookup(inp.data_ptr(), inp.nbytes) if heap is not None and equal else None
    words = signature("reduce_scatter", seq, inp.dtype, inp.numel(), red.name,
                      extra=counts_hash(counts) if block is None else -(1 + block.global_offset))
    if block is None:
        try:
            shm.reduce_scatter(arena, out, inp, counts, red, words, deadline, what)
        except MismatchError:
            _explained(arena, words)
            raise
        return
    L, me, dt, c = arena.size, arena.me, inp.dtype, counts[0]
    numpy = red.numpy_loops
    if numpy:
        bufs = heap.numpy_views(block, inp.nbytes, kernels.NP_DTYPES[dt])
        dst, combine = kernels.numpy_at(out), red.np_combine
    else:
        bufs = heap.tensor_views(block, inp.nbytes, dt)
        dst, combine = out, red.combine
    step = max(1, PIECE_BYTES // dt.itemsize)
    unmap = heap.unmapper(block, c * dt.itemsize)    # (None alone: no peers)

    def pull() -> None:
        for a in range(0, c, step):   # in rank order, as the staged form
            b = min(a + step, c)
            lo, hi = me * c + a, me * c + b
            acc = dst[a:b]
            if L == 1:
                acc[...] = bufs[0][lo:hi]
                continue
            combine(bufs[0][lo:hi], bufs[1][lo:hi], acc)
            for q in range(2, L):
                combine(acc, bufs[q][lo:hi], acc)
            if unmap is not None:
                unmap(lo * dt.itemsize, hi * dt.itemsize)

    _in_place(arena, words, deadline, what, pull)


# -- allocation ------------------------------------------------------------------------
def allocate(arena: ShmArena, heap: SharedHeap, nbytes: int, seq: int, deadline: float,
             cache: bool = True, unmap_peers: bool = False):
    """The collective behind ``empty_shared``: every local rank allocates ``nbytes`` at the
    same offset, or all fail. Returns (block, numpy uint8 array) or None for 0 bytes.
    ``cache``, ``unmap_peers``: ``SharedHeap.alloc``'s (a rank's own choices: they only
    decide what this rank does with its block when it dies and with its peers' pages).

    Word 7 (not compared) carries the cached block each rank proposes; it is reused only
    when every rank proposed the same one (``shm.heap``: Agreement)."""
    words = signature("barrier", seq, torch.uint8, nbytes, root=ALLOC_ROOT,
                      extra=heap.next_offset(nbytes) if nbytes else 0)
    reuse = heap.reusable(nbytes) if nbytes else 0
    barrier = Barriers(arena, words, deadline, f"empty_shared seq {seq}")
    arena.publish(words + (reuse,), new_op=False)
    try:
        barrier()
    except MismatchError:
        _explained(arena, words)
        raise
    if not nbytes:
        return None
    agreed = reuse if all(arena.peer_word(q, 7) == reuse for q in range(arena.size)) else 0
    return heap.alloc(nbytes, deadline, reuse=agreed, cache=cache, unmap_peers=unmap_peers)
