"""``PYCOLL_TRACE`` and ``PYCOLL_DEBUG``: record what a rank really moves, log what pycoll does.

Recording is one hook per executed step (TCP schedules), per barrier (shared memory) and
per collective, each a single ``if tracer is not None`` when nothing is switched on. With
``PYCOLL_TRACE=DIR`` the hook appends a tuple to an in-memory list (no formatting, no I/O:
the tuple holds references to the schedule's immutable step, resolved only at flush). The
list is written to ``DIR/rank{N}.jsonl`` (N: global rank) when the group is destroyed, at
interpreter exit and on ``flush()``; each flush writes and drops what it took.

``PYCOLL_DEBUG=INFO`` logs (logger ``"pycoll"``) the algorithm or path each collective
takes, the first time it takes it; ``TRACE`` logs every collective and every step with its
duration. Without a handler configured by the application, a stderr handler is added.

Clocks: events carry this process's ``time.monotonic()``. When tracing, the first group a
process creates estimates the offset to its rank 0 (``sync_clock``); ``pycoll trace`` (see
``trace_view``) merges the ranks on rank 0's clock. Method and bound: docs/observability.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import zlib

import torch

from pycoll.algorithms.schedule import Copy, Recv, RecvReduce, Reduce, Send

ENV_TRACE, ENV_DEBUG = "PYCOLL_TRACE", "PYCOLL_DEBUG"
TRACE = 5
logging.addLevelName(TRACE, "TRACE")
log = logging.getLogger("pycoll")
CLOCK_TAG = -(1 << 42)      # p2p tags of the clock exchange (monitored_barrier uses -(1 << 40) - k)
CLOCK_ROUNDS = 8
_KIND = {Send: "send", Recv: "recv", RecvReduce: "recv+reduce", Copy: "copy", Reduce: "reduce"}
_SHM_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
            "all_to_all", "barrier")      # shm_collectives.OPS (not imported: no cycle)


# -- clock offsets -------------------------------------------------------------------------
def _boot_id() -> float:
    """A number naming this kernel: processes under one kernel share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return float(zlib.crc32(f.read().strip()))
    except OSError:
        return -1.0


def sync_clock(comm, tag: int = CLOCK_TAG, rounds: int = CLOCK_ROUNDS) -> tuple[float, float, str]:
    """``(offset, error, method)``: rank 0's monotonic clock = this rank's + offset, within ±error.

    Every rank other than 0 runs ping-pongs with rank 0 over the point-to-point engine:
    send t0, rank 0 answers with its clock t1, receive at t2. Rank 0 read t1 between t0 and
    t2, so the offset lies in [t1 - t2, t1 - t0]: the midpoint is the estimate and half the
    round trip the bound, whatever the asymmetry. The sample with the shortest round trip
    wins. Ranks under the same kernel (same boot id) share the clock: offset 0, error 0,
    after one exchange (``PYCOLL_CLOCK_SYNC=measure`` measures anyway, to check the method).
    All ranks of the group must call it together.
    """
    from pycoll.core.executor import byte_view

    rank, world, eng = comm.rank, comm.world, comm.p2p
    if world == 1:
        return 0.0, 0.0, "single rank"
    boot = _boot_id()
    measure = os.environ.get("PYCOLL_CLOCK_SYNC", "") == "measure"  # ping-pong even on one kernel
    deadline = time.monotonic() + comm.timeout

    def xfer(kind, peer, values=None):
        t = torch.tensor(values if values is not None else [0.0, 0.0], dtype=torch.float64)
        fn = eng.isend if kind == "send" else eng.irecv
        req = fn(peer, tag, byte_view(t), "float64", 2, deadline)
        if not req.done.wait(max(0.0, deadline - time.monotonic())) or req.error is not None:
            raise req.error or TimeoutError(f"clock exchange with rank {peer} timed out")
        return t.tolist()

    if rank == 0:
        for peer in range(1, world):
            for k in range(rounds):
                _, their_boot = xfer("recv", peer)
                xfer("send", peer, [time.monotonic(), boot])
                if their_boot == boot and not measure:
                    break
        return 0.0, 0.0, "rank 0 (reference clock)"
    best = None
    for k in range(rounds):
        t0 = time.monotonic()
        xfer("send", 0, [t0, boot])
        t1, their_boot = xfer("recv", 0)
        t2 = time.monotonic()
        if their_boot == boot and not measure:
            return 0.0, 0.0, "same kernel as rank 0 (shared CLOCK_MONOTONIC)"
        if best is None or t2 - t0 < best[0]:
            best = (t2 - t0, t1 - (t0 + t2) / 2)
    return best[1], best[0] / 2, f"ping-pong with rank 0, best of {rounds} (error <= rtt/2)"


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


# -- attaching to a communicator -------------------------------------------------------------
def debug_level() -> int | None:
    text = os.environ.get(ENV_DEBUG, "").strip().upper()
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


def attach(comm) -> None:
    """Set ``comm.tracer`` (and its executors' and arena's) from PYCOLL_TRACE / PYCOLL_DEBUG."""
    global _file
    from pycoll.observe import hangdump

    hangdump.register(comm)
    level = debug_level()
    directory = os.environ.get(ENV_TRACE, "").strip()
    events = None
    if directory:
        import torch.distributed as dist

        with _lock:
            first = _file is None
            if first:
                _file = _RankFile(directory, dist.get_rank() if dist.is_initialized() else comm.rank)
            rf = _file
            gid = rf.next_gid
            rf.next_gid += 1
            events = []
            rf.groups[gid] = (comm, events)
        if first:  # every rank's first traced group: the same group everywhere
            rf.clock = comm.clock = sync_clock(comm)
            offset, error, method = rf.clock
            rf.write({"type": "meta", "rank": rf.rank, "pid": os.getpid(), "clock": "monotonic",
                      "offset_s": offset, "error_s": error, "method": method})
        rf.write({"type": "group", "g": gid, "rank": comm.rank, "world": comm.world, "mode": comm.mode})
    comm.debug = level
    if events is None and level is None:
        return
    comm.tracer = _recorder(comm, events, level)
    for obj in (comm.executor, comm.leader_executor, comm.arena):
        if obj is not None:
            obj.tracer = comm.tracer


def detach(comm, abort: bool = False) -> None:
    """At group destruction: the straggler summary (PYCOLL_DEBUG=INFO), then flush the trace."""
    global _file
    from pycoll.observe import stragglers

    if getattr(comm, "detached", False):
        return
    comm.detached = True
    level = getattr(comm, "debug", None)
    if not abort and comm.error is None and level is not None and level <= logging.INFO:
        try:
            log.info("rank %d: %s", comm.rank, stragglers.format_report(stragglers.collect(comm, 10.0)))
        except Exception as exc:  # noqa: BLE001 - a peer may be gone already
            log.info("rank %d: no straggler summary at destroy: %s", comm.rank, exc)
    with _lock:
        if _file is None:
            return
        for gid, (c, _) in list(_file.groups.items()):
            if c is comm:
                _file.flush()
                del _file.groups[gid]
        if not _file.groups:
            _file.flush()
            _file.f.close()
            _file = None


def _recorder(comm, events: list | None, level: int | None):
    """The hook: ``events.append`` alone when only tracing (the cheapest call there is)."""
    if level is None:
        return events.append
    seen: set = set()
    verbose = level <= TRACE
    append = events.append if events is not None else None

    def record(ev: tuple) -> None:
        if append is not None:
            append(ev)
        if verbose:
            log.log(TRACE, "rank %d: %s", comm.rank, describe_event(ev))
            return
        if ev[0] == "shm":
            return
        key = ("step", ev[1].op, ev[2]) if ev[0] == "step" else ("op", ev[1], ev[5])
        if key not in seen:
            seen.add(key)
            if ev[0] == "step":
                log.info("rank %d: %s uses algorithm %s (world %d, over tcp)", comm.rank, ev[1].op, ev[2],
                         comm.world)
            elif ev[5] != "tcp":  # over tcp, the step's algorithm line says it all
                log.info("rank %d: %s takes the %s path", comm.rank, ev[1], ev[5])
    return record


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
    return {"k": "shm", "g": gid, "op": _SHM_OPS[words[0]], "seq": words[1], "barrier": b, "round": rnd,
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
