"""Work: the handle a c10d call returns, as gloo's: wait, is_completed, exception, future.

A Work completes exactly once, from whichever thread ran the operation. ``wait`` first
helps the group make progress (it runs queued operations up to its own in the calling
thread, which saves a thread handoff on the latency-critical synchronous path), then
blocks with the op's deadline, then re-raises the op's error.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import CommTimeoutError


_FUTURE_LOCK = threading.Lock()


class Work(dist.Work):
    # Defaults live on the class: a Work is made on every call's latency path, and each
    # attribute set in __init__ costs there.
    _error: BaseException | None = None
    _future: torch.futures.Future | None = None  # made on first get_future()
    _settled = False
    _source = -1
    _gate = None
    op_timeout: float | None = None
    _driver = None

    def __init__(self, op: str, seq: int, outputs: list[torch.Tensor], driver=None) -> None:
        super().__init__()
        self.op, self.seq = op, seq
        self._outputs = outputs
        self._driver = driver  # callable(work) that runs queued ops up to this one
        self._done = False
        # Held from creation to completion: waiting is acquiring it. Cheaper to make than
        # an Event, and most Works are waited on once, at once.
        self._gate = threading.Lock()
        self._gate.acquire()

    def complete(self, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._error = error
        self._done = True
        self._gate.release()
        if self._future is not None:
            self._settle()

    def _settle(self) -> None:
        with _FUTURE_LOCK:
            if self._settled:
                return
            self._settled = True
        # Outside the lock: the future's callbacks may use other Works' futures.
        if self._error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(self._error)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._done:
            if self._error is not None:
                raise self._error
            return True
        limit = timeout.total_seconds() if timeout else None
        if not self._done and self._driver is not None and limit is None:
            # Running the queue inline cannot stop at a timeout; with one, the group's
            # worker thread (already notified for async ops) runs it while we wait below.
            self._driver(self)
        if not self._done:
            if not self._gate.acquire(timeout=-1 if limit is None else limit):
                raise CommTimeoutError(f"{self.op} seq {self.seq}: Work.wait timed out after {limit} s",
                                       op=self.op, seq=self.seq)
            self._gate.release()
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self) -> torch.futures.Future:
        with _FUTURE_LOCK:
            if self._future is None:
                self._future = torch.futures.Future()
        if self._done:
            self._settle()
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        self.wait()
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<pycoll.Work {self.op} seq={self.seq} {state}>"


class _Finished(Work):
    """A Work finished at birth: nothing to wait on, so no gate."""

    # pybind's own constructor: a Python __init__ (Work's) would double the cost of making
    # one, and a blocking op makes one on every call's latency path.
    __init__ = dist.Work.__init__
    _done = True


def finished(op: str, seq: int, outputs: list[torch.Tensor], error: BaseException | None = None) -> Work:
    """A Work for an op that already ran (``error``: how it failed; None: it succeeded)."""
    w = _Finished()
    w.op, w.seq, w._outputs = op, seq, outputs
    if error is not None:
        w._error = error
    return w


def completed(op: str, outputs: list[torch.Tensor]) -> Work:
    """An already finished Work (for no-op calls such as world size 1 point-to-point)."""
    return finished(op, -1, outputs)
