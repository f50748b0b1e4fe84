"""What is this rank waiting for: SIGUSR1, and the line logged when a collective fails.

The engine keeps what a dump needs where it is cheap (the op in progress, the executor's
schedule and step, the shared-memory barrier, the TCP step's per-peer progress) and hands it
out as ``Communicator.snapshot()``; this module only formats it. A dump therefore costs the
hot path nothing.

``kill -USR1 <pid>`` logs (logger "pycoll", WARNING) a line per group of the process. The
handler is installed when the first group is created in the main thread (the only thread
that may install one), chains any handler installed before, and is skipped with
``PYCOLL_HANGDUMP=0``. When a collective fails (timeout, dead peer, mismatch), the rank
logs the same description before the group is torn down.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import weakref

from pycoll import settings, wire
from pycoll.core.observer import Observer
from pycoll.shm.rounds import describe_words

log = logging.getLogger("pycoll")
_live: "weakref.WeakSet" = weakref.WeakSet()
_installed = False


class HangDump(Observer):
    """Registers each group for SIGUSR1, and says what it waited for when an op fails."""

    def started(self, comm) -> None:
        _live.add(comm)
        install()

    def failed(self, comm, exc: BaseException) -> None:
        try:
            log.error("rank %d: pending at failure (%s): %s", comm.rank, type(exc).__name__,
                      format_snapshot(comm.snapshot(live=False)))
        except Exception:  # noqa: BLE001 - never mask the original error
            pass


def install() -> bool:
    """Install the SIGUSR1 handler once per process, from the main thread only."""
    global _installed
    if _installed or settings.get("PYCOLL_HANGDUMP") == "0":
        return _installed
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        prev = signal.getsignal(signal.SIGUSR1)

        def handler(signum, frame):
            dump("SIGUSR1")
            if callable(prev):
                prev(signum, frame)
        signal.signal(signal.SIGUSR1, handler)
    except (ValueError, OSError):
        return False
    _installed = True
    return True


def dump(reason: str) -> list[str]:
    """Log (and return) what every live group of this process is doing."""
    out = []
    for comm in list(_live):
        try:
            snap = comm.snapshot()
            if snap["closed"] and snap["current"] is None:
                continue
            text = f"rank {snap['rank']}/{snap['world']} ({reason}): {format_snapshot(snap)}"
        except Exception as exc:  # noqa: BLE001 - a dump must never raise in a signal handler
            text = f"rank {comm.rank} ({reason}): could not describe the pending op: {exc!r}"
        log.warning("%s", text)
        out.append(text)
    return out


def format_snapshot(snap: dict) -> str:
    """One line: the op, its sequence number, step, peers and bytes done of total."""
    cur, queued = snap["current"], snap["queued"]
    if cur is None:
        return f"idle, {queued} op(s) queued" + _p2p(snap["p2p"])
    op, seq, t0 = cur
    recorded = snap.get("recorded", {}).get(seq)
    also = "" if recorded is None else f" (Flight Recorder collective_seq_id {recorded})"
    parts = [f"in {op} seq {seq} ({snap['mode']}){also} for {time.monotonic() - t0:.3f} s, {queued} more queued"]
    for sched, sig, isz, step, progress, ranks in snap["schedules"]:
        if sig.seq == seq:
            parts.append(_schedule_state(sched, isz, step, progress, ranks))
    shm_state = snap["shm"]
    if shm_state is not None and shm_state["words"][1] == seq:
        parts.append(_shm_state(shm_state))
    return "; ".join(parts) + _p2p(snap["p2p"])


def _schedule_state(sched, isz: int, i: int, progress: str | None, ranks: list[int]) -> str:
    acts = []
    for a in sched.steps[i] if 0 <= i < len(sched.steps) else ():
        peer = getattr(a, "peer", None)
        verb = type(a).__name__.lower()
        acts.append(f"{verb} {a.count * isz} B" + ("" if peer is None else f" {'to' if verb == 'send' else 'from'} "
                                                   f"rank {ranks[peer]}"))
    text = f"{sched.name} step {i + 1} of {len(sched.steps)} ({', '.join(acts) or 'local'})"
    return text + (f": {progress}" if progress else "")


def _shm_state(st: dict) -> str:
    words, rnd = st["words"], st["rounds"]
    text = f"shared memory {describe_words(words)}: round {rnd}"
    sig = wire.unpack(words)
    if sig is not None and sig.op in ("all_reduce", "broadcast", "reduce", "all_gather", "gather"):
        total = wire.nbytes(sig)
        cap = st["slot_bytes"]
        text += (f" of {max(1, -(-total // cap))}, {min(total, max(0, rnd - 1) * cap)} of {total} bytes "
                 f"(per rank) in earlier rounds")
    behind = [f"rank {st['ranks'][r]} (at sync {e})" for r, e in enumerate(st["epochs"])
              if r != st["me"] and e < st["epoch"]]
    if behind:
        return text + f"; this rank is at sync {st['epoch']}, waiting for " + ", ".join(behind)
    return text + f"; this rank is at sync {st['epoch']}, no peer behind it (copying or reducing)"


def _p2p(pending: list[str]) -> str:
    if not pending:
        return ""
    more = f" and {len(pending) - 3} more" if len(pending) > 3 else ""
    return "; p2p pending: " + ", ".join(pending[:3]) + more
