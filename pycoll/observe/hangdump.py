"""What is this rank waiting for: ``Communicator.describe_pending``, SIGUSR1, failures.

The state is recorded where it is cheap: the communicator keeps ``current = (op, seq,
arrival)`` per collective, the executor ``current = (schedule, signature, itemsize)`` per
run and ``step`` per step (one attribute store), a shared-memory collective puts its
barrier object on ``arena.pending``. Everything else is read only when a dump is asked
for: the shared-memory sync epochs of the peers, and the TCP transport's own progress
records (``_exchange``'s per-peer send and receive states, found in the stack of the
thread that is inside it). A dump therefore costs the hot path nothing.

``kill -USR1 <pid>`` logs (logger "pycoll", WARNING) a line per group of the process. The
handler is installed when the first group is created in the main thread (the only thread
that may install one), chains any handler installed before, and is skipped with
``PYCOLL_HANGDUMP=0``. When a collective fails (timeout, dead peer, mismatch), the rank
logs the same description before the group is torn down.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import weakref

from pycoll.core import shm_algorithms as shm
from pycoll.transport.shm.arena import LINE

log = logging.getLogger("pycoll")
_live: "weakref.WeakSet" = weakref.WeakSet()
_installed = False
_TCP_FILE = os.path.join("transport", "tcp", "transport.py")


def register(comm) -> None:
    _live.add(comm)
    install()


def install() -> bool:
    """Install the SIGUSR1 handler once per process, from the main thread only."""
    global _installed
    if _installed or os.environ.get("PYCOLL_HANGDUMP", "1") == "0":
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
        if getattr(comm, "_closed", False) and comm.current is None:
            continue
        try:
            text = f"rank {comm.rank}/{comm.world} ({reason}): {describe(comm)}"
        except Exception as exc:  # noqa: BLE001 - a dump must never raise in a signal handler
            text = f"rank {comm.rank} ({reason}): could not describe the pending op: {exc!r}"
        log.warning("%s", text)
        out.append(text)
    return out


def on_failure(comm, exc: BaseException) -> None:
    """A collective failed: say what this rank was waiting for when it did."""
    try:
        log.error("rank %d: pending at failure (%s): %s", comm.rank, type(exc).__name__,
                  describe(comm, live=False))
    except Exception:  # noqa: BLE001 - never mask the original error
        pass


def describe(comm, live: bool = True) -> str:
    """One line: the op, its sequence number, step, peers and bytes done of total.

    ``live=False`` (at a failure, once the transport has returned) leaves out the TCP
    per-peer progress: the error message itself carries it.
    """
    cur = comm.current
    queued = len(comm._queue)
    if cur is None:
        return f"idle, {queued} op(s) queued" + _p2p(comm)
    op, seq, t0 = cur
    parts = [f"in {op} seq {seq} ({comm.mode}) for {time.monotonic() - t0:.3f} s, {queued} more queued"]
    for ex in (comm.executor, comm.leader_executor):
        state = getattr(ex, "current", None) if ex is not None else None
        if state is not None and state[1].seq == seq:
            parts.append(_schedule_state(ex, state, live))
    pending = getattr(comm.arena, "pending", None) if comm.arena is not None else None
    if pending is not None and pending.words[1] == seq:
        parts.append(_shm_state(comm.arena, pending))
    return "; ".join(parts) + _p2p(comm)


def _schedule_state(ex, state, live: bool) -> str:
    sched, sig, isz = state
    i = ex.step
    acts = []
    for a in sched.steps[i] if 0 <= i < len(sched.steps) else ():
        peer = getattr(a, "peer", None)
        verb = type(a).__name__.lower()
        acts.append(f"{verb} {a.count * isz} B" + ("" if peer is None else f" {'to' if verb == 'send' else 'from'} "
                                                   f"rank {_group_rank(ex, peer)}"))
    text = f"{sched.name} step {i + 1} of {len(sched.steps)} ({', '.join(acts) or 'local'})"
    progress = _tcp_progress(ex.transport) if live else ""
    return text + (f": {progress}" if progress else "")


def _group_rank(ex, peer: int) -> int:
    g = getattr(ex.transport, "_g", None)
    return g(peer) if g is not None else peer


def _tcp_progress(transport) -> str:
    """Bytes done per peer, read from the frames of a thread inside TcpTransport._exchange."""
    st = getattr(transport, "_st", None)
    if st is None:
        return ""
    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            code = f.f_code
            if code.co_name == "_exchange" and code.co_filename.endswith(_TCP_FILE):
                loc = f.f_locals
                me = loc.get("self")
                if getattr(me, "_st", None) is st:
                    return _tcp_text(me, loc.get("active") or {}, loc.get("recvs") or {})
            f = f.f_back
    return "between transfers (framing or reducing)"


def _tcp_text(t, sends: dict, recvs: dict) -> str:
    parts = []
    for peer, r in list(recvs.items()):
        got = r.done + (r.off if r.cur is not None else 0)
        parts.append(f"waiting for rank {t._g(peer)}: received {got} of {r.total} bytes")
    for peer, q in list(sends.items()):
        total = sum(len(b) for b in q.bufs)
        parts.append(f"sending to rank {t._g(peer)}: {total - q.left()} of {total} bytes (headers included) "
                     f"accepted")
    return "; ".join(parts) or "all transfers of the step done"


def _shm_state(arena, b) -> str:
    words = b.words
    rnd = arena.rounds - b.round0
    text = f"shared memory {shm.describe(words)}: round {rnd}"
    op, numel, dtype = words[0], words[3], shm.DTYPES[words[2]]
    if shm.OPS[op] in ("all_reduce", "broadcast", "reduce", "all_gather", "gather"):
        total = numel * dtype.itemsize
        cap = arena.slot_bytes
        text += (f" of {max(1, -(-total // cap))}, {min(total, max(0, rnd - 1) * cap)} of {total} bytes "
                 f"(per rank) in earlier rounds")
    epochs = [int(arena._ctrl[r * LINE // 4]) for r in range(arena.size)]
    behind = [f"rank {arena.ranks[r]} (at sync {e})" for r, e in enumerate(epochs)
              if r != arena.me and e < arena.epoch]
    if behind:
        return text + f"; this rank is at sync {arena.epoch}, waiting for " + ", ".join(behind)
    return text + f"; this rank is at sync {arena.epoch}, no peer behind it (copying or reducing)"


def _p2p(comm) -> str:
    eng = getattr(comm, "p2p", None)
    if eng is None:
        return ""
    reqs = list(getattr(eng, "_posted", ()))
    for q in list(getattr(eng, "_sends", {}).values()):
        reqs.extend(list(q))
    reqs = [r for r in reqs if not r.done.is_set()]
    if not reqs:
        return ""
    more = f" and {len(reqs) - 3} more" if len(reqs) > 3 else ""
    return "; p2p pending: " + ", ".join(r.describe() for r in reqs[:3]) + more
