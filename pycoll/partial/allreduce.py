"""The partial all-reduce: its user-facing surface (deposits, results, flush, close).

Who runs each round, and when, is ``serving.RoundServing``; what is in a round, ``rounds``;
the round buffers, ``slots``; the activation messages, ``activation``.
"""


from __future__ import annotations

import struct
import threading
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll import callbacks
from pycoll.errors import CommTimeoutError, PycollError
from pycoll.partial.activation import Activations
from pycoll.partial.rounds import (
    NF,
    Ledger,
    RoundInfo,
)
from pycoll.partial.serving import RoundServing
from pycoll.partial.slots import Slot, SlotPool
from pycoll.partial.work import PartialWork, RoundResult

# Metadata shares the data's buffer: dtypes that hold small integers exactly (< 2**24).
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_STRUCT_CODES = {torch.float32: "f", torch.float64: "d", torch.int32: "i", torch.int64: "q"}
DEFAULT_TIMEOUT = 1800.0


class PartialAllReduce(RoundServing):
    """A persistent partial SUM all-reduce of tensors shaped like ``like`` over ``group``.

    Collective: every rank of ``group`` constructs it (it creates a process group), calls
    ``submit`` once per step, and calls ``flush``/``close`` together at the end.
    ``max_staleness`` = K bounds every contribution's age to K rounds (0: synchronous).
    """

    def __init__(self, like: torch.Tensor, group=None, mode: str = "solo", max_staleness: int = 4,
                 seed: int = 0, timeout: float | timedelta | None = None, history: int = 4096,
                 activation_delay: float = 0.01) -> None:
        if not isinstance(like, torch.Tensor) or like.dtype not in DTYPES or like.device.type != "cpu":
            raise TypeError(f"PartialAllReduce: the template must be a CPU tensor of one of "
                            f"{[str(d) for d in DTYPES]}, got {getattr(like, 'dtype', type(like))}")
        if not activation_delay >= 0:
            raise ValueError(f"PartialAllReduce: activation_delay must be >= 0 s, got {activation_delay!r}")
        self.activation_delay = float(activation_delay)
        group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._ledger = Ledger(self.world, mode, max_staleness, seed)
        self.mode, self.max_staleness, self.seed = mode, max_staleness, seed
        self.shape, self.dtype, self._n = tuple(like.shape), like.dtype, like.numel()
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        self.timeout = float(timeout or DEFAULT_TIMEOUT)
        ranks = dist.get_process_group_ranks(group)
        self._pg = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout),
                                  use_local_synchronization=group is not dist.group.WORLD)
        self._peers = [ranks[r] for r in range(self.world) if r != self.rank]
        self._inline = dist.get_backend(self._pg) == "pycoll"   # see _initiate
        # One lock behind both conditions; code that only needs the lock takes it directly
        # (``with self._cv`` costs two more Python calls, 17 times a round). The per-round
        # notifications look at the Condition's waiters first: notify_all is Python code,
        # and in the common case (one thread drives every round) nobody waits.
        self._lock = lock = threading.Lock()
        self._cv = threading.Condition(lock)     # user threads: deposits, results, hand-overs
        self._wake = threading.Condition(lock)   # the progress thread: something to serve
        self._slots = SlotPool(self._n, self.shape, self.dtype, self.world * NF)   # under _lock
        self._pack_meta = struct.Struct(f"={self.world * NF}{_STRUCT_CODES[self.dtype]}").pack_into
        self._deposits: deque[tuple[int, Slot]] = deque()
        self._next = 0                     # index of this rank's next deposit
        self._results: dict[int, RoundResult] = {}
        self._done = 0                     # rounds completed
        self._flushing, self._flushes, self._flush_round = False, 0, -1
        self._error: BaseException | None = None
        self._closed = False
        self._driver: str | None = None    # who runs rounds now: "thread", "user" or nobody
        self._waiting = 0                  # user threads blocked in wait/flush (they drive)
        self._parked = False               # the progress thread drives but waits for a trigger
        self._activated: set[int] = set()          # rounds an activation arrived for
        self._timer: tuple[int, float] | None = None   # (round, when): activate unless done by then
        # Futures that this object's threads complete settle on runner threads (callbacks.py).
        self._runner = callbacks.Runner(f"pycoll-partial-callbacks-{self.rank}")
        self._act = Activations(self._pg, self.rank, self._peers, lock, self._notify_all,
                                successor=ranks[(self.rank + 1) % self.world], keepalive_s=self.timeout / 4,
                                runner=self._runner)
        self.history: deque[RoundInfo] = deque(maxlen=history)
        self._thread = callbacks.start_thread(self._progress, self._fail, f"pycoll-partial-{self.rank}",
                                              self._runner)

    # ---- the training thread's side ---------------------------------------------------
    def submit(self, tensor: torch.Tensor) -> PartialWork:
        """Deposit ``tensor`` (copied); the handle resolves to the round paired with it."""
        return PartialWork(self, self._deposit(tensor))

    def buffer(self) -> torch.Tensor:
        """A flat tensor of the template's size to fill and pass to ``submit``/``all_reduce``,
        which then deposit it without copying (it belongs to this object again from then)."""
        with self._lock:
            return self._slots.lend()

    def recycle(self, result: RoundResult) -> None:
        """Hand a result's buffer back for reuse once done with it (optional: saves an
        allocation per round; ``result.tensor`` must not be used afterwards)."""
        with self._lock:
            if not self._slots.recycle(result.tensor):
                raise ValueError("PartialAllReduce.recycle: not a round result of this object")

    def all_reduce(self, tensor: torch.Tensor, timeout: float | None = None) -> RoundResult:
        """``submit(tensor).result(timeout)`` in one call: this thread drives the round from
        the start, so the progress thread is never woken to start it (the cheap path when
        nothing runs between submit and wait, as in DDP)."""
        with self._lock:
            self._waiting += 1
        try:
            return self.claim(self._deposit(tensor), timeout)
        finally:
            with self._lock:
                self._waiting -= 1
                self._wake_if_needed()

    def _deposit(self, tensor: torch.Tensor) -> int:
        if tensor.numel() != self._n or tensor.dtype != self.dtype:
            raise ValueError(f"PartialAllReduce.submit: expected {self.dtype}[{self._n}], got "
                             f"{tensor.dtype}[{tensor.numel()}]")
        with self._lock:
            self._check("submit")
            if self._flushing:
                raise RuntimeError("PartialAllReduce.submit: a flush is in progress")
            slot, copy = self._slots.for_deposit(tensor)
        if copy:
            with torch.no_grad():
                slot.data.copy_(tensor.reshape(-1))
        with self._lock:
            index = self._next
            self._next += 1
            self._deposits.append((index, slot))
            if self._cv._waiters:  # a thread driving a round may wait for it
                self._cv.notify_all()
            if not self._waiting:            # else a user thread is about to drive
                self._wake.notify()
        return index

    def flush(self, timeout: float | None = None) -> list[RoundResult]:
        """Collective: run rounds until every rank's deposits are all in; return the results
        of the rounds this rank did not pair with a submit (possibly none), in order."""
        with self._lock:
            self._check("flush")
            start, gen = self._next, self._flushes
            self._flushing = True
            self._notify_all()
        self._drive_until(lambda: self._flushes != gen, timeout, "flush")
        with self._lock:
            return [self._results.pop(k) for k in range(start, self._flush_round + 1)]

    def close(self, flush: bool = True) -> None:
        """Collective: flush (unless ``flush=False``), stop the progress thread, release the
        group. Raises the progress thread's error, if it had one, after releasing."""
        if self._closed:
            return
        flushed = False
        try:
            if flush and self._error is None:
                self.flush()
                flushed = True
        finally:
            with self._lock:
                self._closed = True
                self._notify_all()
            self._thread.join(5)
            self._act.close()
            if flushed:
                dist.barrier(group=self._pg)   # nobody may still be reading the last round
            try:
                dist.destroy_process_group(self._pg)
            except (RuntimeError, ValueError):
                self._pg.shutdown()  # pycoll subgroups lack a c10d group name (docs/partial.md)
            self._runner.close()
        if self._error is not None:
            raise PycollError(f"PartialAllReduce rank {self.rank}: closed after the progress "
                              f"thread failed: {self._error}") from self._error

    def __enter__(self) -> "PartialAllReduce":
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)

    @property
    def last_round(self) -> RoundInfo | None:
        return self.history[-1] if self.history else None

    @property
    def rounds_done(self) -> int:
        """How many rounds have completed on this rank."""
        return self._done

    def claim(self, k: int, timeout: float | None = None) -> RoundResult:
        """The result of round ``k``, running or waiting for rounds until it is done (once)."""
        self._drive_until(lambda: self._done > k, timeout, f"round {k}")
        with self._lock:
            if k not in self._results:
                raise RuntimeError(f"PartialAllReduce: the result of round {k} was already taken")
            return self._results.pop(k)

    def _notify_all(self) -> None:
        """Wake everyone (call holding the lock): an activation, a flush or close."""
        self._cv.notify_all()
        self._wake.notify()

    def _wake_if_needed(self) -> None:
        """The last waiting user thread left (call holding the lock): the progress thread,
        parked while it was there, takes over if something already waits to be served."""
        if not self._waiting and (self._act.ready or self._deposits or self._flushing):
            self._wake.notify()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None and not self._closed:
                self._error = exc
            self._notify_all()

    def _timeout_error(self, msg: str) -> CommTimeoutError:
        return CommTimeoutError(f"PartialAllReduce rank {self.rank}: {msg}", op="partial_all_reduce",
                                seq=self._ledger.k, rank=self.rank)

    def _check(self, what: str) -> None:
        if self._error is not None:
            raise PycollError(f"PartialAllReduce rank {self.rank}: {what}: the progress thread "
                              f"failed: {self._error}") from self._error
        if self._closed:
            raise PycollError(f"PartialAllReduce rank {self.rank}: {what} after close()")
