"""Work handles for CUDA collectives.

``CudaWork`` (nccl and ipc paths): the collective was enqueued on the caller's current stream
and a CUDA event recorded after it. ``wait()`` makes the *current* stream wait on that event and
returns at once, as ProcessGroupNCCL's Work does; the host blocks only when ``wait`` is given a
timeout (then it polls the event until the deadline and raises CommTimeoutError) or on
``synchronize_host()``. ``get_future()`` completes, from a helper thread, once the event has
completed on the device; ``is_completed()`` asks the event.

``StagingWork`` (staging path): wraps the CPU Work of the host copy; when that completes, the
results are copied back to the device (once, by whichever of wait / get_future / is_completed
gets there first) before the handle reports completion.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pycoll import callbacks
from pycoll.core.work import chained_future, settle_source
from pycoll.errors import CommTimeoutError

_POLL = 0.0005


class _Completer:
    """One pycoll thread that waits for CUDA events in issue order; the futures' callbacks
    (user code) run on its callback runner, never on it (pycoll/callbacks.py)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._runner = callbacks.Runner("pycoll-cuda-callbacks")

    def add(self, event, source: torch.futures.Future, value) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = callbacks.start_thread(self._loop, self._failed, "pycoll-cuda-futures",
                                                      self._runner)
        self._q.put((event, source, value))

    def _loop(self) -> None:
        while True:
            event, source, value = self._q.get()
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - delivered to the future
                callbacks.deliver(settle_source, source, None, exc)
            else:
                callbacks.deliver(settle_source, source, value)

    def _failed(self, exc: BaseException) -> None:
        """The thread died: fail what it still held; the next add starts a new one."""
        while not self._q.empty():
            _, source, _ = self._q.get()
            self._runner.submit(settle_source, source, None, exc)


COMPLETER = _Completer()


class CudaWork(dist.Work):
    def __init__(self, op: str, outputs: list[torch.Tensor], event, device: torch.device,
                 source: int = -1) -> None:
        super().__init__()
        self.op, self._outputs, self._event, self._device = op, outputs, event, device
        self._future: torch.futures.Future | None = None
        self._source = source

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = timeout.total_seconds() if timeout else 0.0
        if limit > 0:
            deadline = time.monotonic() + limit
            while not self._event.query():
                if time.monotonic() > deadline:
                    raise CommTimeoutError(f"{self.op}: CUDA work did not finish within {limit} s "
                                           f"(a peer may be missing)", op=self.op)
                time.sleep(_POLL)
            return True
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def synchronize(self) -> None:
        self.wait()

    def synchronize_host(self) -> None:
        """Block the host until the collective has finished on the device."""
        self._event.synchronize()

    def is_completed(self) -> bool:
        return bool(self._event.query())

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            source, self._future = chained_future()
            COMPLETER.add(self._event, source, self._outputs)
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def __repr__(self) -> str:
        return f"<pycoll.cuda.work.CudaWork {self.op} {'done' if self.is_completed() else 'pending'}>"


class StagingWork(dist.Work):
    def __init__(self, op: str, cpu_work, outputs: list[torch.Tensor], copy_back: Callable[[], None]) -> None:
        super().__init__()
        self.op, self._cpu, self._outputs, self._copy_back = op, cpu_work, outputs, copy_back
        self._lock = threading.Lock()
        self._finished = False
        self._future: torch.futures.Future | None = None

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            if self._cpu.exception() is None:
                self._copy_back()
            self._copy_back = None  # drops the pinned host copies
            self._finished = True

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._cpu.wait(timeout)
        self._finish()
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        if not self._finished and self._cpu.is_completed():
            self._finish()
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._cpu.exception() is None

    def exception(self):
        return self._cpu.exception()

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            source, self._future = chained_future()

            def settle(f):
                try:
                    f.value()           # re-raises the CPU op's error
                    self._finish()
                except BaseException as exc:  # noqa: BLE001 - delivered to the future
                    settle_source(source, None, exc)
                else:
                    settle_source(source, self._outputs)
            self._cpu.get_future().add_done_callback(settle)
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return self._cpu.source_rank()

    def _source_rank(self) -> int:
        return self.source_rank()

    def __repr__(self) -> str:
        return f"<pycoll.cuda.work.StagingWork {self.op} {'done' if self._finished else 'pending'}>"
