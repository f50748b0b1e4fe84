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


class Work(dist.Work):
    def __init__(self, op: str, seq: int, outputs: list[torch.Tensor], driver=None) -> None:
        super().__init__()
        self.op, self.seq = op, seq
        self._outputs = outputs
        self._driver = driver  # callable(work) that runs queued ops up to this one
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        self._source = -1

    def complete(self, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = timeout.total_seconds() if timeout else None
        if not self._done.is_set() and self._driver is not None and limit is None:
            # Running the queue inline cannot stop at a timeout; with one, the group's
            # worker thread (already notified for async ops) runs it while we wait below.
            self._driver(self)
        if not self._done.wait(limit):
            raise CommTimeoutError(f"{self.op} seq {self.seq}: Work.wait timed out after {limit} s",
                                   op=self.op, seq=self.seq)
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def get_future(self) -> torch.futures.Future:
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


def completed(op: str, outputs: list[torch.Tensor]) -> Work:
    """An already finished Work (for no-op calls such as world size 1 point-to-point)."""
    w = Work(op, -1, outputs)
    w.complete()
    return w
