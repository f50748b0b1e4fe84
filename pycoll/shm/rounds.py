"""The rounds and barriers of a shared-memory collective, and the signature words it publishes.

A collective publishes its signature (``wire.pack`` of its ``wire.Signature``) and runs in
rounds of at most one slot per rank; ``Barriers`` is its sequence of barriers, the first of
which also checks that every local rank published the same words. What a round stages
(``round_bytes``) is told to the observers with each barrier.
"""

from __future__ import annotations

import time
import zlib

import torch

from pycoll import wire
from pycoll.shm.arena import ShmArena

ONE_SHOT_BYTES = 64 << 10   # all_reduce in one round, each rank reducing all inputs, up to this
# Two ranks stay one-shot longer: the staged-half form saves half the reduction for a second
# barrier, and a barrier costs more than 1 MiB of reduction as soon as a peer may wait for a
# core (docs/performance.md, "One barrier up to 1 MiB on two ranks").
PAIR_ONE_SHOT_BYTES = 1 << 20
# Word values of torch dtypes: a dict lookup by dtype on the latency path (no name formatting).
_DTYPE_WORD = {getattr(torch, name): i for i, name in enumerate(wire.DTYPES)}
_OP_WORD, _REDOP_WORD = wire.OP_WORD, wire.REDOP_WORD


def one_shot_bytes(size: int) -> int:
    """The largest all_reduce that ``size`` local ranks run in one round of one barrier."""
    return PAIR_ONE_SHOT_BYTES if size == 2 else ONE_SHOT_BYTES


def signature(op: str, seq: int, dtype: torch.dtype, numel: int, redop: str = "", root: int = -1,
              extra: int = 0) -> tuple[int, ...]:
    """``wire.pack(Signature(op, seq, dtype, numel, redop, root), extra)``, without building it."""
    return (_OP_WORD[op], seq, _DTYPE_WORD[dtype], numel, _REDOP_WORD[redop], root, extra)


def words_nbytes(words: tuple[int, ...]) -> int:
    """Bytes of the message a rank's words describe (0: none, or no collective)."""
    sig = wire.unpack(words) if words else None
    return wire.nbytes(sig) if sig is not None else 0


def describe_words(words: tuple[int, ...]) -> str:
    sig = wire.unpack(words)
    return sig.describe() if sig is not None else f"<unknown collective {words}>"


def counts_hash(counts) -> int:
    return zlib.crc32(repr(tuple(counts)).encode())


def rounds(n: int, cap: int):
    """(offset, count) of each round; a zero-size collective still has one round."""
    if n == 0:
        yield 0, 0
        return
    for off in range(0, n, cap):
        yield off, min(cap, n - off)


class Barriers:
    """The first barrier of a collective also checks everyone's signature."""

    __slots__ = ("arena", "words", "deadline", "what", "first", "round0", "on_barrier", "count", "t")

    def __init__(self, arena: ShmArena, words: tuple[int, ...], deadline: float, what: str) -> None:
        self.arena, self.words, self.deadline, self.what = arena, words, deadline, what
        self.first = True
        arena.publish(words)
        arena.pending, self.round0, self.on_barrier = self, arena.rounds, arena.on_barrier
        if self.on_barrier is not None:
            self.count, self.t = 0, time.monotonic()

    def __call__(self) -> None:
        if self.on_barrier is not None:
            return self._observed()
        self.arena.sync(self.deadline, self.what)
        if self.first:
            self.first = False
            self.arena.check_signatures(self.words, describe_words)

    def _observed(self) -> None:
        """A barrier, told to the observers with the copy/reduce phase before it."""
        a, t0 = self.arena, time.monotonic()
        a.sync(self.deadline, self.what)
        if self.first:
            self.first = False
            a.check_signatures(self.words, describe_words)
        t1 = time.monotonic()
        self.count += 1
        rnd = a.rounds - self.round0
        self.on_barrier(self.words, self.count, rnd, round_bytes(self.words, rnd, a.slot_bytes, a.size),
                        self.t, t0, t1)
        self.t = t1


def round_bytes(words, rnd: int, slot_bytes: int, size: int) -> int | None:
    """Bytes each rank stages in round ``rnd`` (1-based) of a collective; None: not known here."""
    op, numel, isz = wire.OPS[words[0]], words[3], wire.DTYPE_SIZES[wire.DTYPES[words[2]]]
    if op == "barrier":
        return 0
    if op in ("reduce_scatter", "all_to_all"):
        return None     # per-rank counts travel only as a hash
    cap = slot_bytes // isz // (size if op == "scatter" else 1)
    if op == "all_reduce" and numel * isz <= min(one_shot_bytes(size), slot_bytes):
        cap = numel
    return max(0, min(cap, numel - (rnd - 1) * cap)) * isz
