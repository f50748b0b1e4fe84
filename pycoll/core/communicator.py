"""A communicator: one group's ranks, transports, tuner, executor and ordered op queue.

Operations run one at a time, in the order they were issued, which is also the order of
their sequence numbers (every rank issues the same collectives in the same order, so a
sequence number names one collective on every rank). Asynchronous ops are run by the
group's worker thread; a synchronous op (or a ``wait``) runs the queue up to itself in
the calling thread, so the common blocking call pays no thread handoff.

The first communication error (timeout, dead peer, mismatch) breaks the group, as in
Gloo: the transport is aborted so that peers fail fast too, every queued and later op
fails with an error that points at the original one.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections import deque
from typing import Callable, Sequence

import torch

from pycoll import algorithms, callbacks, settings, torch_compat
from pycoll.core import setup
from pycoll.core.observer import Observer, Observers
from pycoll.core.tuner import Tuner
from pycoll.core.work import Work, finished
from pycoll.errors import CommTimeoutError, PycollError, drop_locals, root_cause
from pycoll.transport import spin
from pycoll.transport.tcp.p2p import P2PEngine

log = logging.getLogger("pycoll")

# A group's lifecycle, every transition in this table (``Communicator._move``):
#   open      takes ops;
#   closing   destroy called: takes no op, waits briefly for the running ones;
#   draining  destroy returned while ops still run (a late peer): the end of the last frees it;
#   freed     sockets, shared memory and threads released.
# A failed group (``error`` set) stays open until destroyed: its ops fail at once.
OPEN, CLOSING, DRAINING, FREED = "open", "closing", "draining", "freed"
LIFECYCLE = {OPEN: {CLOSING}, CLOSING: {DRAINING, FREED}, DRAINING: {FREED}, FREED: set()}

# How long a destroy waits for ops still running (queued async ones, or one a user thread
# drives) before it returns and leaves their end to free the group.
DESTROY_WAIT = 0.5
# How long the exit hook waits, in all, for pycoll's threads to end (callbacks.join_all).
EXIT_JOIN_S = 10.0

Task = Callable[[int, float], None]  # fn(seq, deadline)
ARRIVALS_WINDOW = max(1, settings.get("PYCOLL_STATS_WINDOW"))
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch_compat.set_grad_enabled


@functools.lru_cache(maxsize=1024)
def cached_schedule(collective: str, algo: str, rank: int, world: int, *args):
    """Schedules are pure functions of their arguments, so they are built once and reused."""
    return algorithms.get(collective, algo)(rank, world, *args)


class Communicator:
    """One rank of one group. ``observers``: what watches it (``core.observer``)."""

    recording = 0

    def __init__(self, store, rank: int, world: int, timeout: float, *,
                 observers: Sequence[Observer] = (), algo_overrides: dict[str, str] | None = None) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.observers = obs = Observers(observers)
        w = setup.wire(store, rank, world, timeout, obs.transport)
        self.mode, self.tcp, self.transport, self.executor = w.mode, w.tcp, w.transport, w.executor
        self.arena, self.local_ranks, self.host_of = w.arena, w.local_ranks, w.host_of
        self.heap = None   # registered memory (pycoll.empty_shared), made by its first call
        self.scratch: dict = {}   # pycoll.shared_scratch's tensors, by key
        self.leaders, self.leader_executor = w.leaders, w.leader_executor
        self.executor.on_step = obs.step
        if self.leader_executor is not None:
            self.leader_executor.on_step = obs.step
        if self.arena is not None:
            self.arena.barrier_begins, self.arena.on_barrier = obs.barrier_begins, obs.barrier
        self._before_op, self._after_op, self._failed = obs.before_op, obs.after_op, obs.failed
        # User callbacks of futures that pycoll's own threads complete run here (callbacks.py).
        self.runner = callbacks.Runner(f"pycoll-callbacks-{rank}")
        self.p2p = P2PEngine(rank, world, w.p2p_socks, self.runner, setup.p2p_links(store, w, rank, timeout))
        self.tuner = Tuner(world, algo_overrides, cores=w.crowded_cores)
        self.error: BaseException | None = None
        self._seq = 0
        self._queue: deque[tuple[Work, Task]] = deque()
        # Entered as the raw lock on the latency path (a Condition's __enter__ is Python code).
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._running = False
        self._waiting = 0
        self.state, self._why = OPEN, "process group destroyed"   # (_why: pending p2p's end)
        # What this rank runs now (op, seq, start), for snapshot(); every op's (seq, op,
        # start, end), for pycoll.stats (docs/observability.md).
        self.current: tuple[str, int, float] | None = None
        self.arrivals: deque = deque(maxlen=ARRIVALS_WINDOW)
        # (seq, torch Flight Recorder's collective_seq_id) of the ops the recorder saw, so
        # the hang dump names an op by both; ``recording``: the next op's (``c10d.dispatch``).
        self.recorded: deque = deque(maxlen=256)
        self._worker = callbacks.start_thread(self._work_loop, self.fail, f"pycoll-worker-{rank}",
                                              self.runner)
        _LIVE.add(self)
        if obs.started is not None:
            obs.started(self)

    # -- submission and execution -----------------------------------------------------
    def submit(self, op: str, outputs: list, task: Task, inline: bool,
               timeout: float | None = None) -> Work:
        """Queue ``task``; ``timeout`` (seconds) overrides the group's for this op only."""
        with self._lock:
            if self.state is not OPEN:
                raise PycollError(f"{op}: process group has been destroyed")
            seq = self._seq
            self._seq += 1
            if self.recording:
                self.recorded.append((seq, self.recording))
                self.recording = 0
            # The common blocking call with nothing queued before it runs at once, here:
            # the same as _drive would do, without its queue round trip, and its Work is
            # born finished.
            express = inline and not self._running and not self._queue
            if express:
                self._running = True
            else:
                work = Work(op, seq, outputs, driver=self._drive)
                work.op_timeout = timeout
                self._queue.append((work, task))
                if not inline:
                    self._cv.notify_all()
        if express:
            try:
                error = self._run(op, seq, timeout, task)
            finally:
                self._release()
            return finished(op, seq, outputs, error)
        if inline:
            self._drive(work)
        return work

    def _drive(self, until: Work | None) -> None:
        """Run queued ops in order in this thread, up to and including ``until``."""
        while True:
            with self._lock:
                while self._running:
                    if until is not None and until.is_completed():
                        return
                    self._waiting += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._waiting -= 1
                if (until is not None and until.is_completed()) or not self._queue:
                    return
                work, task = self._queue.popleft()
                self._running = True
            try:
                error = self._run(work.op, work.seq, work.op_timeout, task)
            except BaseException as exc:  # noqa: BLE001 - the op's waiters get it too
                error = exc
                raise
            finally:
                # Done and released before any callback runs: a callback may issue and
                # wait for the next collective, which must find the group free.
                work.mark_done(error)
                self._release()
            work.settle()
            if work is until:
                return

    def _release(self) -> None:
        """The running op is done: let the next driver in (or, in a group destroyed while
        it ran, free the group once nothing is left to run)."""
        with self._lock:
            self._running = False
            free = self.state is DRAINING and not self._queue
            if free:
                self._move(FREED)
            # Wake only a thread that waits for this one (a wake-up per op would cost the
            # synchronous path a context switch of the idle worker).
            if self._waiting or self._queue:
                self._cv.notify_all()
        if free:
            self._free(abort=False)

    def _run(self, op: str, seq: int, timeout: float | None, task: Task) -> BaseException | None:
        """Run one op; returns its error (None: success) for the caller to complete its Work."""
        if self.error is not None:
            return PycollError(f"{op} seq {seq}: process group is unusable after "
                               f"an earlier error: {self.error}")
        if self._before_op is not None:
            self._before_op(op, seq)
        t0 = time.monotonic()
        self.current = (op, seq, t0)
        # Results are written in place into the caller's tensors, which may be leaf
        # parameters that require grad (dist.all_reduce(param) works on gloo); grad mode is
        # per thread and on by default in the worker, so it is off while a task runs.
        grad = _grad_enabled()
        if grad:
            _set_grad_enabled(False)
        limit = timeout or self.timeout
        try:
            task(seq, t0 + limit)
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            if isinstance(exc, CommTimeoutError) and exc.timeout_s is None:
                exc.timeout_s = limit
            if self._failed is not None:
                self._failed(self, exc)
            self.current = None
            # Arguments were validated before submission, so any failure here happened
            # mid-collective: peers may be waiting for frames that will never come. The
            # group is broken and the transports are aborted so that they fail fast too.
            if self.state is not OPEN and exc.args and isinstance(exc.args[0], str):
                exc.args = (f"{exc.args[0]} (the process group was destroyed while this op "
                            f"ran)",) + exc.args[1:]
            self.error = exc
            # Kept by the group and its Work, the error must not keep the op's memory alive
            # (arena views, the caller's tensors): its traceback starts below this frame,
            # which still runs, and the finished frames under it lose their locals.
            exc.__traceback__ = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            drop_locals(exc)
            self.transport.abort(str(exc))
            if self.arena is not None:
                self.arena.abort(root_cause(exc))
            log.error("pycoll rank %d: %s", self.rank, exc)
            return exc
        finally:
            if grad:
                _set_grad_enabled(True)
        t1 = time.monotonic()
        self.arrivals.append((seq, op, t0, t1))
        self.current = None
        if self._after_op is not None:
            self._after_op(op, seq, t0, t1, self.mode)
        return None

    def fail(self, exc: BaseException) -> None:
        """Break the group with ``exc`` (a pycoll thread died of it): abort the transports so
        that peers fail fast, and fail every queued op, whose waiters would wait in vain."""
        if self.error is None:
            self.error = exc
        self.transport.abort(f"{type(exc).__name__}: {exc}")
        if self.arena is not None:
            self.arena.abort(root_cause(exc))
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for work, _task in queued:
            work.complete(PycollError(f"{work.op} seq {work.seq}: process group failed: "
                                      f"{type(exc).__name__}: {exc}"))

    def _work_loop(self) -> None:
        spin.run_in_background()
        while True:
            with self._cv:
                while not self._queue and self.state is OPEN:
                    self._cv.wait()
                if self.state is not OPEN and not self._queue:
                    return
            self._drive(None)

    def run_schedule(self, collective: str, nbytes: int, args: tuple, bufs: dict, sig,
                     reduction, deadline: float, leaders_only: bool = False) -> None:
        """Run the tuner's algorithm over TCP: all ranks, or (``leaders_only``) the host leaders."""
        if leaders_only:
            world, rank, executor = len(self.leaders), self.leaders.index(self.rank), self.leader_executor
        else:
            world, rank, executor = self.world, self.rank, self.executor
        algo = self.tuner.choose(collective, nbytes, world)
        sched = cached_schedule(collective, algo, rank, world, *args)
        executor.run(sched, bufs, sig, reduction, deadline)

    def snapshot(self, live: bool = True) -> dict:
        """What this rank is doing now, for the hang dump (``observe.hangdump``): the op, what
        is queued, each executor's schedule step and the TCP progress of it (``live``), the
        shared-memory barrier state, the point-to-point requests still pending."""
        execs = [ex for ex in (self.executor, self.leader_executor) if ex is not None]
        return {"rank": self.rank, "world": self.world, "mode": self.mode, "state": self.state,
                "closed": self.state is not OPEN, "current": self.current, "queued": len(self._queue),
                "schedules": [p for p in (ex.progress(live) for ex in execs) if p is not None],
                "shm": self.arena.progress() if self.arena is not None else None,
                "p2p": self.p2p.pending(), "recorded": dict(self.recorded)}

    # -- lifecycle -------------------------------------------------------------------
    def shutdown(self, abort=False, reason="aborted by the user", why="process group destroyed") -> None:
        """Destroy the group: release sockets, shared memory and threads. Idempotent.

        Queued and running ops finish as on gloo, and the destroy does not wait for them
        beyond ``DESTROY_WAIT``: an op still running then (another thread's collective
        waiting for a late peer) goes on within its own deadline, completing or failing
        with a timeout that names the peer, and the thread that ends the last op releases
        the group. With ``abort``, ops are failed with ``reason`` at once and released
        with them. Point-to-point requests still pending are failed with ``why``.
        """
        self._why = why
        with self._cv:
            if self.state is not OPEN:
                return
            self._move(CLOSING)
            self._cv.notify_all()
        if abort:
            self._abort_transports(reason)
        limit = 5.0 if abort else self.timeout
        if not abort:
            if threading.current_thread() is not self._worker:
                self._worker.join(DESTROY_WAIT)
            self._wait_idle(DESTROY_WAIT)
            with self._cv:
                if self._running or self._queue:
                    # An op still runs, waiting for a late peer: return now, as gloo's
                    # destroy does. The ops go on within their own deadlines (each completes
                    # if its peers come, or times out naming them), and whichever thread
                    # ends the last one frees the group (_release).
                    self._move(DRAINING)
                    return
        if threading.current_thread() is not self._worker:
            self._worker.join(limit)
        if not self._wait_idle(limit):
            op = self.current
            what = f"{op[0]} seq {op[1]}" if op else "an operation"
            self._abort_transports(f"process group destroyed while {what} was running")
            self._wait_idle(5.0)
        with self._cv:
            self._move(FREED)
        self._free(abort)

    def _move(self, to: str) -> None:
        """The one way the group's state changes (under ``_lock``): only along ``LIFECYCLE``."""
        if to not in LIFECYCLE[self.state]:
            raise AssertionError(f"pycoll rank {self.rank}: group state {self.state} -> {to} is no transition")
        self.state = to

    def _free(self, abort: bool) -> None:
        """Release sockets, shared memory and threads: the group is gone."""
        _LIVE.discard(self)
        if self.observers.closing is not None:
            try:
                self.observers.closing(self, abort)
            except Exception:  # noqa: BLE001 - an observer must not stop the release
                log.exception("pycoll rank %d: an observer failed at destroy", self.rank)
        self.p2p.close(self._why)
        self.transport.close()
        if self.arena is not None:
            self.arena.close()
        self.scratch.clear()    # (before the heap: their blocks go back to it)
        if self.heap is not None:
            self.heap.close()
        self.runner.close()

    def sever(self, reason: str) -> None:
        """Drop every connection without a word (fault injection: what a crash looks like)."""
        self.transport.sever(reason)
        if self.arena is not None:
            self.arena.abort(reason)

    def _abort_transports(self, reason: str) -> None:
        self.transport.abort(reason)
        if self.arena is not None:
            self.arena.abort(reason)

    def _wait_idle(self, seconds: float) -> bool:
        """Wait until no op runs (one a user thread drives); False if one still does."""
        end = time.monotonic() + seconds
        with self._cv:
            while self._running:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._waiting += 1
                try:
                    self._cv.wait(min(left, 1.0))
                finally:
                    self._waiting -= 1
        return True


# Groups not yet freed at interpreter exit (alive, or destroyed with an op still running) are
# ended before Python finalizes, and pycoll's threads waited for: a pycoll thread that
# Python's finalization stops inside torch's C++ code would end the process with
# "terminate called without an active exception" (sys.exit with an op in flight).
_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    reason = "the process is exiting with collectives in flight"
    for comm in list(_LIVE):
        try:
            if comm.state is OPEN:
                comm.shutdown(abort=comm._running or bool(comm._queue), reason=reason)
            else:   # destroyed while an op still ran (DRAINING): end that op now
                comm._abort_transports(reason)
        except Exception:  # noqa: BLE001 - nothing may stop the exit
            log.exception("pycoll rank %d: shutdown at exit failed", comm.rank)
    left = callbacks.join_all(EXIT_JOIN_S)
    if left:
        log.warning("pycoll: threads still running at exit after %.0f s: %s", EXIT_JOIN_S, ", ".join(left))
