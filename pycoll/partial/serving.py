"""Who runs each round of a partial all-reduce, and when.

A background thread serves rounds while the user's thread computes (``_progress``); a user
thread that waits for a result runs them itself (``_drive_until``), the thread stepping
aside. A round starts on its trigger (``_trigger``): an activation from its initiator, or
this rank's own deposit when it may initiate. ``RoundServing`` is a base class of
``allreduce.PartialAllReduce`` and works on that object's state (see its ``__init__``).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.distributed as dist

from pycoll.errors import CommTimeoutError
from pycoll.partial.rounds import NF, Contribution
from pycoll.partial.slots import Slot
from pycoll.partial.work import RoundResult
from pycoll.transport import waits


class RoundServing:
    """The round-driving half of ``PartialAllReduce``."""

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
