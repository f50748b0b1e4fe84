"""Work: the handle a c10d call returns, as gloo's: wait, is_completed, exception, future.

A Work completes exactly once, from whichever thread ran the operation: first it is marked
done (``mark_done``, under no lock), then its future is settled (``settle``), which runs the
user's future callbacks where user code may run (``pycoll.callbacks``). ``wait`` first helps
the group make progress (it runs queued operations up to its own in the calling thread,
which saves a thread handoff on the latency-critical synchronous path), then blocks with
the op's deadline, then re-raises the op's error.

The future torch sees is ``source.then(_unwrap)``: a failed op makes ``_unwrap`` raise, so
the error is held by the C++ future as an error (its ``value()`` throws). Setting a Python
exception as a plain future's result would hand torch's C++ code (the DDP reducer) an
exception object where it expects tensors.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll import callbacks
from pycoll.errors import CommTimeoutError

_FUTURE_LOCK = threading.Lock()


class _Failure:
    """The source future's result when the op failed (see the module docstring)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(source: torch.futures.Future):
    value = source.value()
    if type(value) is _Failure:
        raise value.error
    return value


def chained_future() -> tuple[torch.futures.Future, torch.futures.Future]:
    """(source, public): settle ``source`` with ``settle_source``; hand ``public`` to torch."""
    source = torch.futures.Future()
    return source, source.then(_unwrap)


def settle_source(source: torch.futures.Future, value=None, error: BaseException | None = None) -> None:
    source.set_result(value if error is None else _Failure(error))


class Work(dist.Work):
    # Defaults live on the class: a Work is made on every call's latency path, and each
    # attribute set in __init__ costs there.
    _error: BaseException | None = None
    _future: torch.futures.Future | None = None  # made on first get_future()
    _source: torch.futures.Future | None = None  # the future _future is chained to
    _settled = False
    _src = -1  # the peer a receive got its message from
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
        """Mark done and settle the future (call holding no pycoll lock)."""
        if self.mark_done(error):
            self.settle()

    def mark_done(self, error: BaseException | None = None) -> bool:
        """Done, for waiters; runs no user code. False if it was done already."""
        if self._done:
            return False
        self._error = error
        self._done = True
        self._gate.release()
        return True

    def settle(self) -> None:
        """Settle the future, if anyone asked for one (call holding no pycoll lock)."""
        if self._future is not None:
            callbacks.deliver(self._settle)

    def _settle(self) -> None:
        with _FUTURE_LOCK:
            if self._settled:
                return
            self._settled = True
        # Outside the lock: the future's callbacks may use other Works' futures.
        settle_source(self._source, self._outputs, self._error)

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
                error = CommTimeoutError(f"{self.op} seq {self.seq}: Work.wait timed out after {limit} s",
                                         op=self.op, seq=self.seq)
                error.timeout_s = limit
                raise error
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
                self._source, self._future = chained_future()
        if self._done:
            callbacks.deliver(self._settle)
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        self.wait()
        return self._src

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
