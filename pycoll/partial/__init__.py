"""Partial all-reduce (eager-SGD, Li et al. PPoPP 2020): solo and majority, bounded staleness.

::

    par = pycoll.partial.PartialAllReduce(grad, mode="majority", max_staleness=4)
    for step in range(n):
        work = par.submit(grad)          # deposit this step's tensor; returns at once
        total = work.wait()              # round `step`'s SUM; work.count deposits are in it
        ...                              # e.g. apply total / work.count
        # or, when nothing runs between the two: res = par.all_reduce(grad)
    leftover = par.flush()               # collective: the rounds no submit was paired with
    par.close()

A *round* is one all-reduce, over a private group, of ``[data..., metadata per rank]``.
Round k starts when its *initiator* arrives (solo: the first rank to deposit its k-th
tensor; majority: ``majority_initiator(seed, k)``), which sends an activation (p2p, round
number in the payload, one fixed tag: a posted receive cannot be cancelled, so each rank
keeps exactly one any-source receive posted) unless the round's all-reduce completes within
``activation_delay`` (every rank was on its way: no message needed). Every rank then
contributes its pending deposits of index <= k; later ones go to a later round: never
lost, never counted twice. A background thread serves rounds while the user's thread
computes; a user thread that waits runs them itself. Bookkeeping and the staleness bound:
``partial_rounds.py``; semantics in full: docs/partial.md. Public torch.distributed API
only: any transport.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections import deque
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from pycoll.core import callbacks
from pycoll.errors import CommTimeoutError, PycollError
from pycoll.partial.activation import Activations
from pycoll.partial.rounds import (
    MODES,
    NF,
    Contribution,
    Ledger,
    RoundInfo,
    majority_initiator,
)
from pycoll.partial.work import PartialWork, RoundResult
from pycoll.transport import waits as slow_wait

__all__ = ["PartialAllReduce", "PartialWork", "RoundResult", "RoundInfo", "majority_initiator", "MODES"]

# Metadata shares the data's buffer: dtypes that hold small integers exactly (< 2**24).
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_STRUCT_CODES = {torch.float32: "f", torch.float64: "d", torch.int32: "i", torch.int64: "q"}
DEFAULT_TIMEOUT = 1800.0


class PartialAllReduce:
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
        self._flat_shape = self.shape == (self._n,)
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
        self._slot = self._n + self.world * NF   # a deposit's buffer doubles as a round's
        self._pack_meta = struct.Struct(f"={self.world * NF}{_STRUCT_CODES[self.dtype]}").pack_into
        self._deposits: deque[tuple[int, _Slot]] = deque()
        self._free: list[_Slot] = []          # round buffers ready for reuse
        self._lent: dict[int, _Slot] = {}     # data_ptr -> buffer() out with the user
        self._out: dict[int, _Slot] = {}      # data_ptr -> the latest results, for recycle
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
            slot = self._free.pop() if self._free else self._new_slot()
            self._lent[slot.ptr] = slot
        return slot.data

    def recycle(self, result: RoundResult) -> None:
        """Hand a result's buffer back for reuse once done with it (optional: saves an
        allocation per round; ``result.tensor`` must not be used afterwards)."""
        with self._lock:
            slot = self._out.pop(result.tensor.data_ptr(), None)
            if slot is not None and slot.result is result.tensor:
                self._free.append(slot)
                return
        base = result.tensor._base
        if base is None or base.numel() != self._slot or base.dtype != self.dtype:
            raise ValueError("PartialAllReduce.recycle: not a round result of this object")
        with self._lock:
            if all(s.ptr != base.data_ptr() for s in self._free):   # not twice
                self._free.append(self._new_slot(base))

    def all_reduce(self, tensor: torch.Tensor, timeout: float | None = None) -> RoundResult:
        """``submit(tensor).result(timeout)`` in one call: this thread drives the round from
        the start, so the progress thread is never woken to start it (the cheap path when
        nothing runs between submit and wait, as in DDP)."""
        with self._lock:
            self._waiting += 1
        try:
            return self._claim(self._deposit(tensor), timeout)
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
            ptr = tensor.data_ptr()
            if ptr in self._lent and tensor.is_contiguous():
                slot, copy = self._lent.pop(ptr), False     # filled in place: from buffer()
            else:
                slot = self._free.pop() if self._free else self._new_slot()
                copy = True
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

    def _claim(self, k: int, timeout: float | None) -> RoundResult:
        self._drive_until(lambda: self._done > k, timeout, f"round {k}")
        with self._lock:
            if k not in self._results:
                raise RuntimeError(f"PartialAllReduce: the result of round {k} was already taken")
            return self._results.pop(k)

    def _drive_until(self, done, timeout: float | None, what: str) -> None:
        """Wait for ``done()``; meanwhile run rounds in this thread, the progress thread
        stepping aside (it serves rounds only while the user's thread is busy elsewhere).
        A progress thread that is only parked, waiting for a round to start, is relieved
        without waking it: the common path (submit, then wait) costs no thread handoff."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            self._waiting += 1
        try:
            while True:
                with self._lock:
                    while True:
                        if done():
                            return
                        self._check(what)
                        if self._driver is None or (self._driver == "thread" and self._parked):
                            self._driver = "user"
                            break
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise self._timeout_error(f"{what} not done after {limit} s")
                        self._cv.wait(left)
                try:
                    self._round(deadline, what)
                except CommTimeoutError:
                    raise           # only raised before the round's all-reduce: nothing broken
                except BaseException as exc:
                    self._fail(exc)
                    raise
                finally:
                    with self._lock:
                        self._driver = None
                        if self._cv._waiters:
                            self._cv.notify_all()
        finally:
            with self._lock:
                self._waiting -= 1
                self._wake_if_needed()

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

    # ---- the progress thread -----------------------------------------------------------
    def _progress(self) -> None:
        try:
            if self.world > 1:
                self._act.post()
                self._act.start_keepalive()
            while True:
                fire = None
                with self._lock:
                    while (self._driver is not None or self._waiting) and not self._closed:
                        timer = self._timer
                        if timer is None:
                            self._wake.wait()
                        elif timer[1] <= time.monotonic():
                            fire, self._timer = timer[0], None
                            break
                        else:
                            self._wake.wait(timer[1] - time.monotonic())
                    if fire is None:
                        if self._closed:
                            return
                        self._driver = "thread"
                if fire is not None:
                    self._act.send(fire)     # the user thread's round is late: activate
                    continue
                try:
                    self._round(None, "")
                finally:
                    with self._lock:
                        if self._driver == "thread":   # else a user thread relieved it
                            self._driver = None
                            self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - rethrown on the user's next call
            self._fail(exc)

    def _round(self, deadline: float | None, what: str) -> None:
        """Run round k, or step back (return early) before it starts. ``deadline``: the user
        thread's (the progress thread waits without one: an idle rank is not an error)."""
        led, k = self._ledger, self._ledger.k
        how = self._await(lambda: self._trigger(k), lambda: self._waiting_for_trigger(k), deadline, what)
        if how is None:
            return
        need = led.must_include(self.rank)
        if need is not None and self._await(lambda: self._next > need or self._flushing,
                                            lambda: f"its own deposit {need} (staleness bound)",
                                            deadline, what) is None:
            return
        slot, mine = self._snapshot(k, how == "initiate")
        if how == "initiate":
            self._initiate(slot.base, k, deadline is None)
        else:
            dist.all_reduce(slot.base, group=self._pg)
        info = led.close_round(slot.meta.reshape(self.world, NF).astype(np.int64).tolist())  # exact
        if info.counts[self.rank] != mine.count:
            raise RuntimeError(f"PartialAllReduce round {k}: metadata says rank {self.rank} "
                               f"contributed {info.counts[self.rank]}, it sent {mine.count}")
        result = RoundResult(slot.result, info.count, info)
        with self._lock:
            self._timer = None
            self._results[k] = result
            self._out[slot.ptr] = slot
            if len(self._out) > _KEEP_FOR_RECYCLE:
                del self._out[next(iter(self._out))]
            self.history.append(info)
            self._done = k + 1
            if info.flush:
                self._flushing = False
                self._flush_round = k
                self._flushes += 1
                self._next = k + 1          # deposit index == round index again
            if self._cv._waiters:
                self._cv.notify_all()
        if self._activated:
            self._activated = {m for m in self._activated if m > k}

    def _initiate(self, buf: torch.Tensor, k: int, from_progress_thread: bool) -> None:
        """The initiator's all-reduce of round k. Peers get an activation at once, or, when a
        user thread initiates, only if the all-reduce is still waiting ``activation_delay``
        from now: when every rank arrives within that grace period (balanced steps), no
        message is sent. On pycoll the all-reduce itself sends them (it runs in this thread:
        ``pycoll.slow_wait``); on other backends the progress thread keeps the time."""
        late_hook = contextlib.nullcontext()
        if self.world > 1:
            if from_progress_thread or self.activation_delay <= 0:
                self._act.send(k)
            elif self._inline:
                late_hook = slow_wait.on_slow(self.activation_delay, lambda: self._act.send(k))
            else:
                with self._lock:
                    self._timer = (k, time.monotonic() + self.activation_delay)
                    self._wake.notify()
        with late_hook:
            dist.all_reduce(buf, group=self._pg)

    def _trigger(self, k: int) -> str | None:
        if k in self._activated:
            return "activated"
        has = self._next > k or self._flushing
        if has and self._ledger.may_initiate(self.rank):
            return "initiate"
        if has and self._driver == "user":
            # The user's thread is blocked until a round at or after k completes, so this
            # rank's contribution to round k cannot grow: enter now, without waiting for the
            # initiator's activation (the all-reduce still completes only once it arrives).
            return "ready"
        return None

    def _waiting_for_trigger(self, k: int) -> str:
        who = self._ledger.initiator()
        src = "any rank" if who is None else f"rank {who}"
        return f"round {k} to start (an activation from {src}, or this rank's deposit {k})"

    def _await(self, ready, describe, deadline: float | None, what: str):
        """Wait for ``ready()`` (truthy) while serving activations. None: step back (closed,
        or the progress thread yielding to a user thread that waits and will drive)."""
        cond = self._wake if deadline is None else self._cv   # deadline None: the progress thread
        while True:
            with self._lock:
                while True:
                    if self._closed or (deadline is None and (self._waiting or self._driver != "thread")):
                        return None
                    if self._act.ready:
                        break
                    value = ready()
                    if value:
                        return value
                    if deadline is None:
                        self._parked = True    # a waiting user thread may take over now
                        cond.wait()
                        self._parked = False
                        continue
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._timeout_error(f"{what}: still waiting for {describe()}")
                    cond.wait(left)
                self._act.ready = False
            if self._closed:
                return None
            k = self._act.take()  # outside the lock: it posts a receive
            if k >= self._ledger.k:
                self._activated.add(k)

    def _snapshot(self, k: int, initiated: bool) -> tuple[_Slot, Contribution]:
        """This rank's slot for round k: every pending deposit of index <= k, plus metadata.
        A single deposit (the common case) is its own round buffer: no copy."""
        taken = []
        with self._lock:
            while self._deposits and self._deposits[0][0] <= k:
                taken.append(self._deposits.popleft())
            left, flushing = len(self._deposits), self._flushing
        if len(taken) == 1:
            slot = taken[0][1]
        else:
            slot = self._new_slot()
            data = slot.data
            if taken:
                data.copy_(taken[0][1].data)
                for _, t in taken[1:]:
                    data.add_(t.data)
            else:
                data.zero_()
        mine = Contribution(len(taken), taken[0][0] if taken else 0, taken[-1][0] if taken else 0,
                            initiated, flushing, left)
        # The whole metadata area in one struct call (the other ranks' rows are zero): two
        # numpy slice assignments, one from a list, cost several times as much.
        rows = [0] * (self.world * NF)
        rows[self.rank * NF:(self.rank + 1) * NF] = mine.row(k)
        self._pack_meta(slot.meta, 0, *rows)
        if len(taken) > 1:
            with self._lock:
                self._free.extend(t for _, t in taken)
        return slot, mine

    def _new_slot(self, base: torch.Tensor | None = None) -> _Slot:
        base = torch.empty(self._slot, dtype=self.dtype) if base is None else base
        data = base[:self._n]
        return _Slot(base, data, data if self._flat_shape else data.view(self.shape),
                     base.detach().numpy()[self._n:], base.data_ptr())


# Results whose buffers recycle() takes back without looking at them (a result that is never
# recycled keeps its buffer alive until this many later results are made).
_KEEP_FOR_RECYCLE = 2


class _Slot(NamedTuple):
    """A round buffer and its views, made once per buffer: a view costs a microsecond or more,
    and every round needs three."""

    base: torch.Tensor     # the template's elements, then world * NF metadata
    data: torch.Tensor     # base[:n], flat
    result: torch.Tensor   # data shaped like the template
    meta: np.ndarray       # base[n:] in numpy (a few small writes a round, no dispatcher cost)
    ptr: int               # base.data_ptr()
