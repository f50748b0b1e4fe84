"""``PYCOLL_TRACE`` and ``PYCOLL_DEBUG``: record what a rank really moves, log what pycoll does.

``Tracer`` is an observer (``core.observer``): it is attached only when either variable
is set, so with neither the engine's hooks stay None and cost one test each. With
``PYCOLL_TRACE=DIR`` the hook appends a tuple to an in-memory list (no formatting, no I/O:
the tuple holds references to the schedule's immutable step, resolved only at flush). The
list is written to ``DIR/rank{N}.jsonl`` (N: global rank) when the group is destroyed, at
interpreter exit and on ``flush()``; each flush writes and drops what it took.

``PYCOLL_DEBUG=INFO`` logs (logger ``"pycoll"``) the algorithm or path each collective
takes, the first time it takes it; ``TRACE`` logs every collective and every step with its
duration. Without a handler configured by the application, a stderr handler is added.

Clocks: events carry this process's ``time.monotonic()``. When tracing, the first group a
process creates estimates the offset to its rank 0 (``clock.sync_clock``); ``pycoll trace``
(``cli/trace_view``) merges the ranks on rank 0's clock. Method and bound: docs/observability.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading

from pycoll import settings
from pycoll.algorithms.schedule import Copy, Recv, RecvReduce, Reduce, Send
from pycoll.core.observer import Observer
from pycoll.observe.clock import offset_of
from pycoll.wire import OPS

ENV_TRACE, ENV_DEBUG = "PYCOLL_TRACE", "PYCOLL_DEBUG"
TRACE = 5
logging.addLevelName(TRACE, "TRACE")
log = logging.getLogger("pycoll")
_KIND = {Send: "send", Recv: "recv", RecvReduce: "recv+reduce", Copy: "copy", Reduce: "reduce"}


# -- the rank file -------------------------------------------------------------------------
class _RankFile:
    """DIR/rank{N}.jsonl of this process: one meta line, a line per group, a line per event."""

    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        self.rank = rank
        self.f = open(self.path, "w")
        self.groups: dict[int, tuple[object, list]] = {}   # gid -> (communicator, events)
        self.next_gid = 0
        self.clock: tuple[float, float, str] | None = None

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        for gid, (_, events) in list(self.groups.items()):
            n = len(events)
            batch = events[:n]
            del events[:n]      # appends from the worker thread land after n: nothing is lost
            for ev in batch:
                self.write(resolve(ev, gid))
        self.f.flush()


_lock = threading.RLock()
_file: _RankFile | None = None


def flush() -> str | None:
    """Write what this process recorded so far; returns the file's path (None: not tracing)."""
    with _lock:
        if _file is None:
            return None
        _file.flush()
        return _file.path


@atexit.register
def _flush_at_exit() -> None:
    try:
        flush()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


# -- the observer ----------------------------------------------------------------------------
def debug_level() -> int | None:
    text = settings.get(ENV_DEBUG).upper()
    if not text:
        return None
    level = {"INFO": logging.INFO, "TRACE": TRACE, "DEBUG": TRACE, "WARN": logging.WARNING,
             "WARNING": logging.WARNING}.get(text)
    if level is None:
        raise ValueError(f"{ENV_DEBUG}={text!r}: choose INFO or TRACE")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("pycoll %(levelname)s %(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > level:
        log.setLevel(level)
    return level


def wanted() -> bool:
    """Whether PYCOLL_TRACE or PYCOLL_DEBUG asks for a Tracer."""
    return bool(settings.get(ENV_TRACE)) or debug_level() is not None


class Tracer(Observer):
    """One group's PYCOLL_TRACE recording and PYCOLL_DEBUG logging."""

    def __init__(self) -> None:
        self.level = debug_level()
        self.directory = settings.get(ENV_TRACE)
        self.events: list | None = [] if self.directory else None
        self.comm = None
        self.record = None
        self._seen: set = set()

    def started(self, comm) -> None:
        global _file
        self.comm = comm
        if self.directory:
            import torch.distributed as dist

            with _lock:
                first = _file is None
                if first:
                    _file = _RankFile(self.directory, dist.get_rank() if dist.is_initialized() else comm.rank)
                rf = _file
                self.gid = rf.next_gid
                rf.next_gid += 1
                rf.groups[self.gid] = (self, self.events)
            if first:  # every rank's first traced group: the same group everywhere
                rf.clock = offset_of(comm)
                offset, error, method = rf.clock
                rf.write({"type": "meta", "rank": rf.rank, "pid": os.getpid(), "clock": "monotonic",
                          "offset_s": offset, "error_s": error, "method": method})
            rf.write({"type": "group", "g": self.gid, "rank": comm.rank, "world": comm.world, "mode": comm.mode})
        # Only tracing: appending to the list is the whole hook (the cheapest call there is).
        self.record = self.events.append if self.level is None else self._record_and_log

    def after_op(self, op, seq, t0, t1, mode) -> None:
        self.record(("op", op, seq, t0, t1, mode))

    def step(self, sig, algo, i, step, itemsize, t0, t1) -> None:
        self.record(("step", sig, algo, i, step, itemsize, t0, t1))

    def barrier(self, words, b, rnd, nbytes, tp, t0, t1) -> None:
        self.record(("shm", words, b, rnd, nbytes, tp, t0, t1))

    def closing(self, comm, abort: bool) -> None:
        """The straggler summary (PYCOLL_DEBUG=INFO), then flush the trace."""
        global _file
        from pycoll.observe import stragglers

        if not abort and comm.error is None and self.level is not None and self.level <= logging.INFO:
            try:
                log.info("rank %d: %s", comm.rank, stragglers.format_report(stragglers.collect(comm, 10.0)))
            except Exception as exc:  # noqa: BLE001 - a peer may be gone already
                log.info("rank %d: no straggler summary at destroy: %s", comm.rank, exc)
        with _lock:
            if _file is None:
                return
            for gid, (owner, _) in list(_file.groups.items()):
                if owner is self:
                    _file.flush()
                    del _file.groups[gid]
            if not _file.groups:
                _file.flush()
                _file.f.close()
                _file = None

    def _record_and_log(self, ev: tuple) -> None:
        if self.events is not None:
            self.events.append(ev)
        comm = self.comm
        if self.level <= TRACE:
            log.log(TRACE, "rank %d: %s", comm.rank, describe_event(ev))
            return
        if ev[0] == "shm":
            return
        key = ("step", ev[1].op, ev[2]) if ev[0] == "step" else ("op", ev[1], ev[5])
        if key not in self._seen:
            self._seen.add(key)
            if ev[0] == "step":
                log.info("rank %d: %s uses algorithm %s (world %d, over tcp)", comm.rank, ev[1].op, ev[2],
                         comm.world)
            elif ev[5] != "tcp":  # over tcp, the step's algorithm line says it all
                log.info("rank %d: %s takes the %s path", comm.rank, ev[1], ev[5])


# -- events ----------------------------------------------------------------------------------
# ("op", op, seq, t0, t1, mode)                              a collective, arrival to end
# ("step", sig, algo, i, step, itemsize, t0, t1)             a schedule step over TCP
# ("shm", words, barrier, round, nbytes, t_phase, t0, t1)    a shared-memory barrier and the
#                                                            copy/reduce phase before it
def resolve(ev: tuple, gid: int = 0) -> dict:
    """A recorded tuple -> the JSON record written to the rank file."""
    kind = ev[0]
    if kind == "op":
        _, op, seq, t0, t1, mode = ev
        return {"k": "op", "g": gid, "op": op, "seq": seq, "mode": mode, "t0": t0, "t1": t1}
    if kind == "step":
        _, sig, algo, i, step, isz, t0, t1 = ev
        sent = recv = local = 0
        peers, acts = [], []
        for a in step:
            n = a.count * isz
            name = _KIND[type(a)]
            if isinstance(a, Send):
                sent += n
            elif isinstance(a, (Recv, RecvReduce)):
                recv += n
            else:
                local += n
                acts.append(f"{name} {n}")
                continue
            if a.peer not in peers:
                peers.append(a.peer)
            acts.append(f"{name} {'->' if name == 'send' else '<-'}{a.peer} {n}")
        peer = peers[0] if len(peers) == 1 else (peers or None)
        return {"k": "step", "g": gid, "op": sig.op, "seq": sig.seq, "algo": algo, "step": i, "peer": peer,
                "bytes": sent + recv + local, "sent": sent, "recv": recv, "actions": ", ".join(acts),
                "t0": t0, "t1": t1}
    _, words, b, rnd, nbytes, tp, t0, t1 = ev
    return {"k": "shm", "g": gid, "op": OPS[words[0]], "seq": words[1], "barrier": b, "round": rnd,
            "bytes": nbytes, "t0": tp, "tb": t0, "t1": t1}


def describe_event(ev: tuple) -> str:
    r = resolve(ev)
    us = (r["t1"] - r["t0"]) * 1e6
    if r["k"] == "op":
        return f"{r['op']} seq {r['seq']} ({r['mode']}): {us:.1f} us"
    if r["k"] == "step":
        return f"{r['op']} seq {r['seq']} {r['algo']} step {r['step']}: {r['actions']}: {us:.1f} us"
    return (f"{r['op']} seq {r['seq']} shm round {r['round']} barrier {r['barrier']}: {r['bytes']} bytes, "
            f"work {(r['tb'] - r['t0']) * 1e6:.1f} us, barrier wait {(r['t1'] - r['tb']) * 1e6:.1f} us")
