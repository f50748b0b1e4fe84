"""Shared-memory transport: the Transport interface over an arena of one host's ranks.

With it the executor runs any schedule between the ranks of one host, as it does over TCP,
and the same conformance kit checks it (pycoll/testing/conformance.py). The shared-memory
collectives (pycoll/shm/algorithms.py) do not use it: they keep the arena's slots and barriers
for themselves. A transport owns an arena of its own (``ShmTransport.connect``) and uses it
for the segment (its lifetime: nothing to leak, see arena.py), the peers' pids and the init
barrier; it never calls the arena's barrier afterwards.

The layout (a page per rank with its counters, state and doorbell, then a mailbox per
destination: a ring of bytes with one writer and one reader, carrying the pair's frames as
on the wire) is in ``pycoll.testing.mailbox``.

Waits: an exchange progresses every send and receive of its step in one loop (so two ranks
sending each other more than a mailbox at once cannot deadlock); when nothing moves, it
spins briefly (``SPIN_CAP``, and only where every rank has a core: the arena's ``spin``),
then sleeps in FUTEX_WAIT on its own doorbell in slices of ``WAIT_SLICE``, checking between
them the deadline, the peers' states and whether the peers' processes live. A rank that
changes anything a peer may wait for (counters, its state) bumps its own byte lane of the
peer's doorbell (lane = rank mod 4) and wakes it. With distinct lanes (world <= 4) no
wake-up can be missed: a waiter that read the doorbell before the change sees the counter
after it or finds the doorbell changed. With more ranks lanes are shared and a lost
increment can cost one wait slice, never a hang.

How it compares with TCP on loopback: docs/transports.md.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Sequence

from pycoll.errors import CommError, CommTimeoutError, PeerClosedError
from pycoll.transport import waits
from pycoll.transport.base import InFrame, OutFrame, Transport, control_error, death_error, timeout_error
from pycoll.shm import futex
from pycoll.shm.arena import ShmArena
from pycoll.testing.mailbox import (
    ABORTED,
    CLOSED,
    MIN_MAILBOX,
    OPEN,
    SEVERED,
    Mailboxes,
    RecvState,
    SendState,
    slot_bytes_for,
)
from pycoll.wire import ABORT, BYE, Header, Signature

DEFAULT_MAILBOX_BYTES = 1 << 20
WAIT_SLICE = 0.05
# A spin only pays while the peer is on a core, answering within a round trip (15 us here).
# The arena's 2 ms budget made an exchange on a busy host take the whole 2 ms (the peer
# waited for the core the spinner held): 2000 us per ping-pong, against 40 us blocking at
# once and 16 us with this cap.
SPIN_CAP = 100e-6


class ShmTransport(Transport):
    name = "shm"

    @classmethod
    def connect(cls, store, key: str, local_rank: int, size: int, ranks: list[int], timeout: float,
                mailbox_bytes: int = DEFAULT_MAILBOX_BYTES) -> "ShmTransport":
        """Build an arena for this transport alone (collective over the local ranks)."""
        mailbox = max(MIN_MAILBOX, -(-mailbox_bytes // 64) * 64)
        return cls(ShmArena(store, key, local_rank, size, ranks, timeout,
                            slot_bytes=slot_bytes_for(size, mailbox)))

    def __init__(self, arena: ShmArena) -> None:
        self.arena = arena
        self.rank, self.world, self.ranks = arena.me, arena.size, list(arena.ranks)
        self.box = Mailboxes(arena)
        self.mailbox = self.box.size
        self._lock = threading.Lock()      # held by exchange; close waits for it
        self._failure: CommError | None = None
        self.aborted: str | None = None
        self._closed = False
        self._progress = None

    def _rank_of(self, r: int) -> int:
        return self.ranks[r] if 0 <= r < len(self.ranks) else r

    # -- data path ---------------------------------------------------------------------
    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        if self._closed:
            raise CommError(f"{what}: rank {self._rank_of(self.rank)}'s shared-memory transport is closed",
                            rank=self._rank_of(self.rank))
        if self.aborted is not None:
            raise self._aborted_error(what)
        sends: dict[int, SendState] = {}
        for f in outs:
            q = sends.setdefault(f.peer, SendState())
            q.bufs.append(f.header)
            if len(f.payload):
                q.bufs.append(f.payload if f.payload.format == "B" else f.payload.cast("B"))
            q.total += len(f.header) + len(f.payload)
        recvs: dict[int, RecvState] = {}
        for f in ins:
            st = recvs.setdefault(f.peer, RecvState())
            st.frames.append(f)
            st.total += len(f.dest)
        interrupted = None
        with self._lock:
            self._progress = (sends, recvs)
            try:
                self._run(sends, recvs, deadline, what)
            except CommError as exc:
                self._fail(exc)
                raise
            except BaseException as exc:
                # Interrupted mid-frame (KeyboardInterrupt, a failing reduction): the rings
                # may stand mid-frame, so this transport must not be used again.
                interrupted = exc
                self._fail(PeerClosedError(f"{what}: rank {self._rank_of(self.rank)} was interrupted: "
                                           f"{type(exc).__name__}: {exc}", rank=self._rank_of(self.rank)))
                raise
            finally:
                self._progress = None
                if interrupted is not None:
                    self._publish(ABORTED)

    def _run(self, sends: dict, recvs: dict, deadline: float, what: str) -> None:
        box, spin_end = self.box, None
        alive_at = time.monotonic() + WAIT_SLICE
        while sends or recvs:
            bell = box.bell[0]   # read before looking: a change after it ends the wait below
            moved = False
            for peer in list(sends):
                q = sends[peer]
                moved |= box.send_some(peer, q)
                if q.i == len(q.bufs):
                    del sends[peer]
            for peer in list(recvs):
                st = recvs[peer]
                moved |= box.recv_some(peer, st, what)
                if st.cur is None and not st.frames:
                    del recvs[peer]
            if not (sends or recvs):
                return
            if self._closed:
                raise CommError(f"{what}: rank {self._rank_of(self.rank)}'s shared-memory transport was "
                                f"closed during the exchange", rank=self._rank_of(self.rank))
            if self.aborted is not None:
                raise self._aborted_error(what)
            now = time.monotonic()
            if moved:
                spin_end = None
                if now > deadline:
                    raise self._timeout(sends, recvs, what)
                continue
            self._check_peers(sends, recvs, what)
            if now >= deadline:
                raise self._timeout(sends, recvs, what)
            if self.arena.spin:
                if spin_end is None:
                    spin_end = now + min(self.arena.spin, SPIN_CAP, waits.due(now))
                if now < spin_end:
                    continue
            futex.wait(box.bell_at[self.rank].value, bell, min(deadline - now, WAIT_SLICE, waits.due(now)))
            if time.monotonic() >= alive_at:
                self._check_alive(sends, recvs, what)
                alive_at = time.monotonic() + WAIT_SLICE

    # -- failures ----------------------------------------------------------------------
    def _check_peers(self, sends: dict, recvs: dict, what: str) -> None:
        """Nothing moved: raise if a peer aborted, or left while this step still needs it."""
        for peer in range(self.world):
            if peer == self.rank:
                continue
            state = self.box.state(peer)
            if state == OPEN:
                continue
            if peer in recvs and self.box.unread(peer) > 0:
                continue   # frames it wrote before it stopped are read first, as on TCP
            if state == ABORTED:
                raise self._peer_error(peer, ABORT, what)
            if state == SEVERED:
                raise self._died(peer, what, "")
            if peer in recvs or peer in sends:
                raise self._peer_error(peer, BYE, what)

    def _check_alive(self, sends: dict, recvs: dict, what: str) -> None:
        for peer, pid in enumerate(self.arena.pids):
            if peer == self.rank or not pid or pid == os.getpid() or futex.alive(pid):
                continue
            if self.box.state(peer) == CLOSED and peer not in sends and peer not in recvs:
                continue   # it closed cleanly and exited: nobody waits for it
            self._check_peers(sends, recvs, what)  # it may have said why before it went
            raise self._died(peer, what, f" (pid {pid})")

    def _peer_error(self, peer: int, kind: int, what: str) -> CommError:
        reason, error, origin = self.box.reason(peer)
        hdr = Header(kind, Signature("control", -1, "", 0, error, origin), 0, 0, len(reason))
        return control_error(hdr, reason, self._rank_of(self.rank), self._rank_of(peer), what)

    def _died(self, peer: int, what: str, pid: str) -> PeerClosedError:
        return death_error(what, self._rank_of(self.rank), self._rank_of(peer),
                           f"{pid.strip()} died (killed or crashed); rank {self._rank_of(self.rank)} saw "
                           f"it in a shared-memory exchange".lstrip())

    def _timeout(self, sends: dict, recvs: dict, what: str) -> CommTimeoutError:
        parts = [f"received {st.done + (st.off if st.cur is not None else 0)} of {st.total} bytes from "
                 f"rank {self._rank_of(p)}" for p, st in recvs.items()]
        parts += [f"rank {self._rank_of(p)} has not yet taken {q.left()} of {q.total} bytes sent to it"
                  for p, q in sends.items()]
        peer = self._rank_of(next(iter(recvs), next(iter(sends), -1)))
        return timeout_error(what, self._rank_of(self.rank), peer, " in shared memory", parts)

    def _fail(self, exc: CommError) -> None:
        if self._failure is None:
            self._failure = exc
        if self.aborted is None:
            self.aborted = str(exc)

    def _aborted_error(self, what: str) -> PeerClosedError:
        f = self._failure
        exc = PeerClosedError(f"{what}: rank {self._rank_of(self.rank)}: transport was aborted ({self.aborted})",
                              rank=self._rank_of(self.rank), peer=f.peer if f is not None else -1)
        if f is not None:
            exc.origin, exc.root_cause = f.origin, f.root_cause
        return exc

    def progress(self) -> str:
        """Bytes done per peer of the step in progress (read from another thread: a snapshot)."""
        state = self._progress
        if state is None:
            return "between transfers (framing or reducing)"
        sends, recvs = state
        parts = [f"waiting for rank {self._rank_of(p)}: received {st.done + st.off} of {st.total} bytes"
                 for p, st in list(recvs.items())]
        parts += [f"sending to rank {self._rank_of(p)}: {q.total - q.left()} of {q.total} bytes written"
                  for p, q in list(sends.items())]
        return "; ".join(parts) or "all transfers of the step done"

    # -- lifecycle ---------------------------------------------------------------------
    def _publish(self, state: int, reason: str = "") -> None:
        if self._closed and state != CLOSED:
            return
        f, me = self._failure, self._rank_of(self.rank)
        if f is None:
            self.box.publish(state, f"rank {me}: {reason}", "PeerClosedError", me)
        else:   # a failure of this rank's own: peers report its root cause, as over TCP
            self.box.publish(state, f.root_cause or str(f), type(f).__name__,
                             f.origin if f.origin >= 0 else me)

    def abort(self, reason: str) -> None:
        """Make this rank's exchanges and every peer's fail promptly with ``reason``."""
        if self._closed:
            return
        if self.aborted is None:
            self.aborted = reason
        self._publish(ABORTED, reason)

    def sever(self, reason: str) -> None:
        """Fault injection: peers see this rank gone without a reason, as after a crash."""
        if self._closed:
            return
        if self.aborted is None:
            self.aborted = reason
        self._publish(SEVERED)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.box.ring(self.rank)   # an exchange running in another thread fails now
        locked = self._lock.acquire(timeout=1.0)
        try:
            self._publish(CLOSED)   # a goodbye, unless this rank aborted first
            if locked:   # (else that exchange still reads the views: the mapping stays)
                self.box.release()
            self.arena.close()
        finally:
            if locked:
                self._lock.release()
