"""Where user code runs: never on a thread that pycoll needs next, never under a pycoll lock.

A Work's future runs its ``then`` / ``add_done_callback`` callbacks inline, inside torch's
``set_result``, on whichever thread settles it. User callbacks may start collectives and
wait for them (torch's PowerSGD hook does), so the thread that settles a future must not be
one that those collectives need: a group's worker, the point-to-point progress thread, the
partial all-reduce's thread. Those threads are started with ``start_thread``, which marks
them internal and guards them (``guard``); a future completed on one of them is settled by
the callback runner instead. A future completed on a user's own thread (a blocking call, a
``wait``) is settled inline there, after every pycoll lock is released.

A runner is a pool of daemon threads, one pool per group, that grows whenever all of its
threads are busy: a callback that waits for another future (``...get_future().wait()``)
never waits for a thread held by the callback itself. Idle threads beyond the first exit
after ``IDLE_S``; all of them when the group is destroyed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import Callable

log = logging.getLogger("pycoll")

IDLE_S = 5.0
CLOSE_WAIT_S = 5.0   # how long closing a group waits for callbacks still running
_local = threading.local()
# Every thread pycoll starts, so that the exit hook can wait for them (``join_all``).
_STARTED: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def is_internal() -> bool:
    """True on a thread that pycoll needs to make progress (user code must not run here)."""
    return getattr(_local, "runner", None) is not None


def guard(body: Callable[[], None], on_error: Callable[[BaseException], None], name: str,
          runner: "Runner") -> None:
    """Run a pycoll thread's ``body``, marked internal (its user code goes to ``runner``); any
    exception it lets out fails its owner (``on_error``) instead of ending the thread in
    silence, which would leave every waiter hanging."""
    _local.runner = runner
    try:
        body()
    except BaseException as exc:  # noqa: BLE001 - the owner re-raises it to every waiter
        log.error("pycoll thread %s failed: %r", name, exc, exc_info=True)
        try:
            on_error(exc)
        except BaseException:  # noqa: BLE001 - nothing is left to tell
            log.exception("pycoll thread %s: failing its owner failed too", name)


def start_thread(body: Callable[[], None], on_error: Callable[[BaseException], None], name: str,
                 runner: "Runner") -> threading.Thread:
    """A started daemon thread that runs ``body`` under ``guard``."""
    t = threading.Thread(target=guard, args=(body, on_error, name, runner), name=name, daemon=True)
    _STARTED.add(t)
    t.start()
    return t


def join_all(seconds: float) -> list[str]:
    """Wait up to ``seconds`` in all for every thread pycoll started to end; the names of
    those still alive then.

    Called at interpreter exit, before Python finalizes: a daemon thread that is inside
    torch's C++ with the GIL released then (settling a future, reducing a tensor) is stopped
    by finalization when it takes the GIL back, an unwind that C++ turns into
    "terminate called without an active exception" (SIGABRT) after a job that succeeded.
    """
    deadline = time.monotonic() + seconds
    me = threading.current_thread()
    for t in list(_STARTED):
        if t is not me:
            t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in list(_STARTED) if t.is_alive() and t is not me]


class Runner:
    """Daemon threads that run what pycoll's internal threads hand over (user callbacks).

    One per owner (a group), closed with it: its idle threads end then, and anything handed
    over later runs on a thread of its own that ends after it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._jobs: deque = deque()
        self._idle = 0
        self._threads = 0
        self._closed = False

    def submit(self, fn: Callable, *args) -> None:
        with self._lock:
            self._jobs.append((fn, args))
            # One runner for every pending job: a job must never wait behind another one,
            # which may be a callback blocked until this job's future is settled.
            spawn = len(self._jobs) > self._idle
            if spawn:
                self._threads += 1
            else:
                self._cv.notify_all()   # (close() may wait on the same condition)
        if spawn:
            t = threading.Thread(target=self._serve, name=self.name, daemon=True)
            _STARTED.add(t)
            t.start()

    def _serve(self) -> None:
        _local.serving = self
        while True:
            with self._lock:
                while not self._jobs:
                    if self._closed:
                        self._threads -= 1
                        self._cv.notify_all()   # close() may wait for the last one
                        return
                    self._idle += 1
                    notified = self._cv.wait(timeout=IDLE_S)
                    self._idle -= 1
                    if not notified and not self._jobs and self._threads > 1:
                        self._threads -= 1
                        self._cv.notify_all()
                        return
                fn, args = self._jobs.popleft()
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a user callback's error is the user's
                log.exception("pycoll: a future callback raised")

    def close(self, wait: float = CLOSE_WAIT_S) -> None:
        """End the idle threads, and wait up to ``wait`` seconds for the ones still running
        callbacks: a daemon thread still inside torch's C++ (settling a future) when the
        interpreter exits is stopped by an unwind that C++ turns into std::terminate."""
        mine = getattr(_local, "serving", None) is self
        deadline = time.monotonic() + wait
        with self._lock:
            self._closed = True
            self._cv.notify_all()
            while self._threads > (1 if mine else 0) and time.monotonic() < deadline:
                self._cv.wait(timeout=max(0.0, deadline - time.monotonic()))


def deliver(fn: Callable, *args) -> None:
    """Run ``fn(*args)`` (code that may run user callbacks) where user code may run: here on
    a user's thread, on the thread's runner when called from a pycoll thread."""
    runner = getattr(_local, "runner", None)
    if runner is None:
        fn(*args)
    else:
        runner.submit(fn, *args)
