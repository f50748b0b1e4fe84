"""Shared-memory arena for the ranks of one host: an anonymous shared segment plus futex-based sync.

Layout: one 512-byte control line per local rank (its sync epoch, abort flag, pid and the
signatures of its current and previous collective), then two staging slots per rank (double-buffered:
a round writes one parity while peers may still read the other).

Lifetime: local rank 0 creates the segment with ``memfd_create``, which gives it no name in
any file system, and publishes its ``/proc/<pid>/fd/<n>`` path through the Store; every
local rank opens that path (the kernel lets only the creator's user, and root, do it: the
ptrace read check) and maps it, and rank 0 closes its descriptor once all have. The memory
lives exactly as long as a mapping or descriptor of it, so ``kill -9`` of any rank at any
moment, during init too, leaves nothing behind: there is nothing in /dev/shm to leak.

Sync: ``sync()`` is a barrier over epochs. Each rank owns its epoch word (single writer, so
a plain store suffices on x86's ordered stores). A waiter polls briefly, yielding the core at
each turn, only while no other task waits for a core (``transport.spin``: decided at run
time, per wait), then raises
its sleep word and blocks in FUTEX_WAIT in slices of 50 ms, between which it checks the
deadline, peers' abort flags and whether the peer's process still exists. A rank blocked in
a barrier therefore uses almost no CPU, and a dead peer is noticed within 50 ms. A rank that
advances its epoch calls FUTEX_WAKE only when a peer's sleep word is up. (The waiter's sleep
word is ordered before its epoch read by the kernel's barrier in FUTEX_WAIT; the waker's
epoch store and sleep-word load have no fence between them, so in theory a wake-up can be
missed: the cost is one wait slice, never a hang.)
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
import time

import numpy as np
import torch

from pycoll import settings
from pycoll.errors import MismatchError, PeerClosedError
from pycoll.transport import spin as spinning
from pycoll.transport import waits
from pycoll.transport.base import death_error, timeout_error
from pycoll.shm import futex, segment

LINE = 512                  # bytes of control per rank
SLEEP = 3                   # int32 word of a rank's line: set while it may block in FUTEX_WAIT
SIG_WORDS = 8               # int64 signature words per slot; two slots at bytes 64 and 128
REASON_AT = 192             # a rank's abort reason (text, 319 bytes) fills the rest of its line
WAIT_SLICE = 0.05

log = logging.getLogger("pycoll")

# The longest a barrier polls (when nothing else wants the core; transport/spin.py): it must
# outlast a futex wake-up (50-250 us on this VM, sometimes more), or two ranks fall into
# taking turns to sleep, each waking the other late. Spinning 2000 polls (~0.3 ms) left whole
# runs of 8 B - 64 KiB all_reduces at 270-450 us; 2 ms, at 40-80 us (docs/shm.md).
SPIN_SECONDS = 0.002


@functools.lru_cache(maxsize=None)
def _pack_words(n: int):
    return struct.Struct(f"{n}q").pack_into


class ShmArena:
    """Shared staging memory and barriers for ``size`` ranks of one host (local ranks)."""

    # Observer hooks (core/observer.py), None when nobody watches: before each barrier, and
    # after it (called by the shared-memory algorithms, which know what the round moved).
    barrier_begins = None
    on_barrier = None
    published: tuple[int, ...] = ()   # this rank's signature words of its current collective
    pending = None  # the running collective's barriers (its words, its first round), for progress()

    def __init__(self, store, key: str, local_rank: int, size: int, ranks: list[int],
                 timeout: float, slot_bytes: int | None = None) -> None:
        self.me, self.size, self.ranks = local_rank, size, ranks  # ranks: group rank of each local rank
        slot = slot_bytes or settings.get("PYCOLL_SHM_SLOT_BYTES")
        self.slot_bytes = max(4096, slot // 4096 * 4096)
        self.ctrl_bytes = -(-size * LINE // 4096) * 4096
        total = self.ctrl_bytes + 2 * size * self.slot_bytes
        self.mm, creator = _map_segment(store, key, local_rank, size, total, timeout)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self._ctrl = np.frombuffer(self.mm, dtype=np.int32, count=self.ctrl_bytes // 4)
        self._sig = np.frombuffer(self.mm, dtype=np.int64, count=self.ctrl_bytes // 8)
        # Scalar reads and writes of control words through a memoryview cost a third of
        # numpy's: they sit on every barrier's path.
        self._words = memoryview(self.mm)[:self.ctrl_bytes].cast("i")
        self._slots = torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.ctrl_bytes,
                                       count=2 * size * self.slot_bytes)
        self.epoch = 0
        self.spin = SPIN_SECONDS if size > 1 else 0.0
        self._tasks = spinning.RunnableTasks()
        self.spins = spinning.SpinPolicy(self.spin, self._tasks)
        w = self._me_word = self.me * LINE // 4
        self._my_epoch = ctypes.c_void_p(self._base + w * 4)
        self._peer_epoch_words = tuple((r, r * LINE // 4) for r in range(size) if r != local_rank)
        self._peer_sleep_words = tuple(word + SLEEP for _, word in self._peer_epoch_words)
        # Byte offset of every local rank's signature slot, by collective parity (see publish).
        self._sig_offsets = tuple(tuple(r * LINE + 64 + parity * 8 * SIG_WORDS for r in range(size))
                                  for parity in (0, 1))
        self._ctrl[w + 2] = os.getpid()
        self.closed = False
        # Whose death a barrier can notice: the creator's pid is known from its segment's
        # path, the others' once they have written their control line (0: not yet).
        self.pids: list[int] = [0] * size
        self.pids[0], self.pids[local_rank] = creator, os.getpid()
        self._typed: dict = {}
        self._np_views: dict = {}
        self.rounds = 0
        self._unsynced_round = False
        self.ops = 0
        try:
            self.sync(time.monotonic() + timeout, "shm init")  # everyone's pid is visible after this
        except BaseException:
            # The error's traceback keeps this half-built arena alive: release its memory and
            # its run-queue fd (a raw fd: no collector would close it) now.
            self.closed = True
            self._release()
            raise
        self.pids = [int(self._ctrl[r * LINE // 4 + 2]) for r in range(size)]

    # -- data ----------------------------------------------------------------------------
    def slot(self, rank: int, parity: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The staging slot of local rank ``rank`` for round parity ``parity``, typed."""
        key = (rank, parity, dtype)
        view = self._typed.get(key)
        if view is None:
            start = (2 * rank + parity) * self.slot_bytes
            view = self._slots[start:start + self.slot_bytes].view(dtype)
            self._typed[key] = view
        return view

    def next_parity(self) -> int:
        """Rounds alternate between the two slot halves (shm/algorithms.py says why two are enough)."""
        # Two parity steps without a barrier between them would let this rank overwrite a
        # slot half that a slower peer may still be reading: a bug, never a choice.
        assert not self._unsynced_round, "shm round started without a barrier after the previous one"
        self._unsynced_round = True
        self.rounds += 1
        return self.rounds & 1

    # -- signatures ----------------------------------------------------------------------
    def publish(self, words: tuple[int, ...], new_op: bool = True) -> None:
        """Publish this rank's signature for its next collective.

        Signatures alternate between two slots by collective: a rank may publish its next
        signature as soon as it leaves a collective, while a slower peer still checks the
        current one; it reuses that slot only after the next collective's first barrier.
        """
        if new_op:
            self.ops += 1
        self.published = words
        _pack_words(len(words))(self.mm, self._sig_offsets[self.ops & 1][self.me], *words)

    def _sig_at(self, rank: int) -> int:
        """Byte offset of local rank ``rank``'s signature slot for the current collective."""
        return self._sig_offsets[self.ops & 1][rank]

    def peer_word(self, rank: int, index: int) -> int:
        """Signature word ``index`` that local rank ``rank`` published for this collective."""
        return int(self._sig[self._sig_at(rank) // 8 + index])

    def check_signatures(self, words: tuple[int, ...], describe) -> None:
        """After a sync: raise MismatchError naming every local rank that published other words."""
        n = len(words)
        mm, nbytes, offsets = self.mm, 8 * n, self._sig_offsets[self.ops & 1]
        at = offsets[self.me]
        mine = mm[at:at + nbytes]
        for at in offsets:  # the common path: a bytes compare a rank
            if mm[at:at + nbytes] != mine:
                break
        else:
            return
        start = offsets[0]
        lines = self._sig.reshape(-1, LINE // 8)[:self.size]
        block = lines[:, start // 8:start // 8 + n]
        others = {self.ranks[r]: f"rank {self.ranks[r]} called {describe(tuple(int(x) for x in row))}"
                  for r, row in enumerate(block) if tuple(int(x) for x in row) != words}
        raise MismatchError(f"collective mismatch: rank {self.ranks[self.me]} called {describe(words)} "
                            f"but " + ", ".join(others.values()), rank=self.ranks[self.me],
                            peer=next(iter(others)))

    def numpy_slots(self, parity: int, dtype: np.dtype, count: int | None = None) -> list[np.ndarray]:
        """Every local rank's staging slot for ``parity`` as numpy arrays, in rank order,
        whole or their first ``count`` elements (the small-message path: numpy calls cost
        less than torch's, and views made once cost nothing)."""
        key = (parity, dtype, count)
        views = self._np_views.get(key)
        if views is None:
            if len(self._np_views) >= 256:   # many distinct small sizes: start over
                self._np_views.clear()
            n = self.slot_bytes // dtype.itemsize if count is None else count
            views = [np.frombuffer(self.mm, dtype=dtype, count=n,
                                   offset=self.ctrl_bytes + (2 * rank + parity) * self.slot_bytes)
                     for rank in range(self.size)]
            self._np_views[key] = views
        return views

    # -- sync ----------------------------------------------------------------------------
    def sync(self, deadline: float, what: str) -> None:
        """Barrier of all local ranks (every rank calls sync the same number of times)."""
        if self.barrier_begins is not None:
            self.barrier_begins(self)
        self.epoch += 1
        self._unsynced_round = False
        target = self.epoch
        me_word = self._me_word
        ctrl = self._words
        if ctrl[me_word + 1]:
            raise PeerClosedError(f"{what}: rank {self.ranks[self.me]}'s shared-memory group was aborted: "
                                  f"{self._reason(self.me)}", rank=self.ranks[self.me])
        ctrl[me_word] = target
        # A futex wake is a system call (0.8 us); make it only when a peer may be asleep.
        for w in self._peer_sleep_words:
            if ctrl[w]:
                futex.wake(self._my_epoch)
                break
        slept = polling = False
        spins = self.spins
        for r, word in self._peer_epoch_words:
            while True:
                v = ctrl[word]
                if v >= target:
                    break
                # Re-read the epoch after seeing the abort word: a peer may pass this barrier
                # and then leave between the two reads, and that is no failure of ours.
                if ctrl[word + 1] and ctrl[word] < target:
                    raise PeerClosedError(f"{what}: rank {self.ranks[r]} left the group: {self._reason(r)}",
                                          rank=self.ranks[self.me], peer=self.ranks[r])
                if not slept:
                    now = time.monotonic()
                    if not polling:   # (a partial all-reduce's activation hook is not kept waiting)
                        polling = spins.begin(now, waits.due(now))
                        if polling:
                            continue
                    elif spins.poll(now):
                        continue
                    polling = False
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    raise timeout_error(what, self.ranks[self.me], self.ranks[r], " in shared memory",
                                        [f"it is at sync {v}, this rank at {target}"])
                if not slept:
                    ctrl[me_word + SLEEP] = slept = 1
                futex.wait(self._base + word * 4, v, min(left, WAIT_SLICE, waits.due(now)))
                if ctrl[word] == v:
                    pid = self.pids[r] or ctrl[word + 2]
                    if pid and not futex.alive(pid):
                        raise death_error(what, self.ranks[self.me], self.ranks[r], f"(pid {pid}) died")
        if slept:
            ctrl[me_word + SLEEP] = 0
            spins.unanswered()
        else:
            spins.answered()

    def progress(self) -> dict | None:
        """The running collective's barrier state, for the hang dump: its signature words, how
        many rounds it has run, this rank's epoch and every local rank's."""
        b = self.pending
        if b is None or self.closed:
            return None
        return {"words": b.words, "rounds": self.rounds - b.round0, "epoch": self.epoch,
                "epochs": [int(self._ctrl[r * LINE // 4]) for r in range(self.size)],
                "ranks": self.ranks, "me": self.me, "slot_bytes": self.slot_bytes}

    def _reason(self, rank: int) -> str:
        start = rank * LINE + REASON_AT
        text = bytes(self.mm[start:start + LINE - REASON_AT]).split(b"\0", 1)[0]
        return text.decode("utf-8", "replace") or "aborted"

    def abort(self, reason: str = "") -> None:
        """Make peers' barriers fail fast; ``reason`` (truncated) is what they will report."""
        if self.closed:
            return
        if not self._ctrl[self._me_word + 1]:   # the first reason is the one peers report
            data = reason.encode("utf-8", "replace")[:LINE - REASON_AT - 1] + b"\0"
            start = self.me * LINE + REASON_AT
            self.mm[start:start + len(data)] = data
        # A separate abort word, so that a peer still reading this rank's epoch for a
        # barrier it legitimately passed is not misled; the wake makes waiters re-check.
        self._ctrl[self._me_word + 1] = 1
        futex.wake(self._my_epoch)

    def close(self) -> None:
        if self.closed:
            return
        # Tell peers still waiting in a barrier that this rank is gone (a clean destroy
        # keeps the process alive, so the pid check alone would not end their wait).
        self.abort("destroyed its process group")
        self.closed = True
        self._release()

    def _release(self) -> None:
        self._tasks.close()
        # The numpy/torch/ctypes views export the mmap's buffer; drop them before closing.
        self._words.release()
        del self._ctrl, self._sig, self._slots, self._words
        self._typed.clear()
        self._np_views.clear()
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a slot view: the mapping goes with the last of them


def _map_segment(store, key: str, local_rank: int, size: int, total: int, timeout: float):
    return segment.map_segment(store, key, local_rank, size, total, time.monotonic() + timeout, "shm init",
                               "arena")
