"""The engine of a partial all-reduce: its deposits and results, and who runs each round, when.

``RoundServer`` holds the whole state of one ``PartialAllReduce`` (which validates the user's
calls and hands them here). A background thread serves rounds while the user's thread
computes (``_progress``); a user thread that waits for a result runs them itself
(``_drive_until``), the thread stepping aside. A round starts on its trigger (``_trigger``): an
activation from its initiator, or this rank's own deposit when it may initiate. What is in a
round is ``rounds``; the round buffers, ``slots``; the activation messages, ``activation``.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from pycoll import callbacks
from pycoll.errors import CommTimeoutError, PycollError
from pycoll.partial.activation import Activations
from pycoll.partial.rounds import NF, Contribution, Ledger, RoundInfo
from pycoll.partial.slots import Slot, SlotPool
from pycoll.partial.work import RoundResult
from pycoll.transport import waits

_STRUCT_CODES = {torch.float32: "f", torch.float64: "d", torch.int32: "i", torch.int64: "q"}


class RoundServer:
    """The rounds of one partial all-reduce over process group ``pg`` (``ranks``: its global
    ranks), for tensors of ``n`` elements of ``dtype`` (results shaped ``shape``): made once
    the caller has checked every argument; ``close`` ends it."""

    def __init__(self, pg, ranks: list[int], rank: int, ledger: Ledger, n: int, shape: tuple,
                 dtype: torch.dtype, timeout: float, activation_delay: float, history: int) -> None:
        self._pg, self.rank, self.world = pg, rank, len(ranks)
        self._ledger = ledger
        self.timeout, self.activation_delay = timeout, activation_delay
        self._n = n
        self._peers = [ranks[r] for r in range(self.world) if r != rank]
        self._inline = dist.get_backend(pg) == "pycoll"   # see _initiate
        # One lock behind both conditions; code that only needs the lock takes it directly
        # (``with self._cv`` costs two more Python calls, 17 times a round). The per-round
        # notifications look at the Condition's waiters first: notify_all is Python code,
        # and in the common case (one thread drives every round) nobody waits.
        self._lock = lock = threading.Lock()
        self._cv = threading.Condition(lock)     # user threads: deposits, results, hand-overs
        self._wake = threading.Condition(lock)   # the progress thread: something to serve
        self._slots = SlotPool(self._n, shape, dtype, self.world * NF)   # under _lock
        self._pack_meta = struct.Struct(f"={self.world * NF}{_STRUCT_CODES[dtype]}").pack_into
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
        self._runner = callbacks.Runner(f"pycoll-partial-callbacks-{rank}")
        self._act = Activations(pg, rank, self._peers, lock, self._notify_all,
                                successor=ranks[(rank + 1) % self.world], keepalive_s=timeout / 4,
                                runner=self._runner)
        self.history: deque[RoundInfo] = deque(maxlen=history)
        self._thread = callbacks.start_thread(self._progress, self._fail, f"pycoll-partial-{rank}",
                                              self._runner)

    # ---- the user's calls (checked by PartialAllReduce) ---------------------------------
    def buffer(self) -> torch.Tensor:
        """A round buffer lent to the user (``PartialAllReduce.buffer``)."""
        with self._lock:
            return self._slots.lend()

    def recycle(self, result: RoundResult) -> None:
        """A result's buffer back for reuse (``PartialAllReduce.recycle``)."""
        with self._lock:
            if not self._slots.recycle(result.tensor):
                raise ValueError("PartialAllReduce.recycle: not a round result of this object")

    def all_reduce(self, tensor: torch.Tensor, timeout: float | None = None) -> RoundResult:
        """Deposit and claim, this thread driving the round from the start (no wake-up)."""
        with self._lock:
            self._waiting += 1
        try:
            return self.claim(self.deposit(tensor), timeout)
        finally:
            with self._lock:
                self._waiting -= 1
                self._wake_if_needed()

    def deposit(self, tensor: torch.Tensor) -> int:
        """Deposit ``tensor`` (of the right size and dtype: checked by the caller); its index."""
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
        """``PartialAllReduce.flush``: the results no submit of this rank is paired with."""
        with self._lock:
            self._check("flush")
            start, gen = self._next, self._flushes
            self._flushing = True
            self._notify_all()
        self._drive_until(lambda: self._flushes != gen, timeout, "flush")
        with self._lock:
            return [self._results.pop(k) for k in range(start, self._flush_round + 1)]

    def close(self, flush: bool = True) -> None:
        """``PartialAllReduce.close``: the progress thread's error, if any, raised last."""
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

    # ---- the rounds ----------------------------------------------------------------------
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
            self._slots.keep_result(slot)
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
        ``pycoll.transport.waits``); on other backends the progress thread keeps the time."""
        late_hook = contextlib.nullcontext()
        if self.world > 1:
            if from_progress_thread or self.activation_delay <= 0:
                self._act.send(k)
            elif self._inline:
                late_hook = waits.OnSlow(self.activation_delay, lambda: self._act.send(k))
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

    def _snapshot(self, k: int, initiated: bool) -> tuple[Slot, Contribution]:
        """This rank's slot for round k: every pending deposit of index <= k, plus metadata.
        A single deposit (the common case) is its own round buffer: no copy."""
        taken = []
        with self._lock:
            while self._deposits and self._deposits[0][0] <= k:
                taken.append(self._deposits.popleft())
            left, flushing = len(self._deposits), self._flushing
        slot = taken[0][1] if len(taken) == 1 else self._slots.combine([t for _, t in taken])
        mine = Contribution(len(taken), taken[0][0] if taken else 0, taken[-1][0] if taken else 0,
                            initiated, flushing, left)
        # The whole metadata area in one struct call (the other ranks' rows are zero): two
        # numpy slice assignments, one from a list, cost several times as much.
        rows = [0] * (self.world * NF)
        rows[self.rank * NF:(self.rank + 1) * NF] = mine.row(k)
        self._pack_meta(slot.meta, 0, *rows)
        if len(taken) > 1:
            with self._lock:
                self._slots.give_back([t for _, t in taken])
        return slot, mine
