"""TCP transport, failure handling ("never hang"): ABORT and BYE frames, watching idle
connections, the errors a step raises, and abort/sever/close.

- While waiting, every other connection of the mesh is watched for its peer hanging up
  (POLLRDHUP), not only the ones this step uses: a rank blocked on a live peer still learns
  within milliseconds that some other rank died or aborted (``_inspect``), or that it sent
  a frame of another collective (``_peek``: a mismatch).
- A rank that fails sends an ABORT frame (reason, error class, rank where the failure
  started) on every connection before shutting it down, so every rank reports the root
  cause ("rank 2 died", "collective mismatch: ...") rather than "rank 1 closed". A frame
  that was half sent is first completed with zero bytes so the ABORT lands on a frame
  boundary (the failed collective's output is undefined anyway).
- A clean ``close`` sends a BYE frame first (also at interpreter exit). So end of stream
  without BYE or ABORT means the peer died; on a connection this step does not use it is
  acted on after ``DEAD_PEER_GRACE`` seconds, in case the step completes without that peer.

``FailureHandling`` is a base class of ``tcp.TcpTransport``: its methods use the
transport's ``rank``, ``conns``, ``_shared`` (a ``SharedState``), ``_rank_of`` and ``aborted``.
"""

from __future__ import annotations

import atexit
import os
import select
import socket
import threading
import time
import weakref

from pycoll.errors import (
    CommError,
    CommTimeoutError,
    MismatchError,
    PeerClosedError,
    ProtocolError,
)
from pycoll.transport import spin
from pycoll.transport.base import control_error, death_error, timeout_error
from pycoll.transport.frames import control_reason, frames, garbage, next_frame
from pycoll.transport.tcp.conn import READ_AHEAD, Conn, RecvState, SendState
from pycoll.wire import (
    ABORT,
    BYE,
    DATA,
    control_frame,
)

DEAD_PEER_GRACE = 1.0     # seconds between an idle connection's EOF and calling its peer dead
ABORT_GRACE = 0.25        # seconds spent delivering ABORT frames before shutting sockets
MAX_PAD = 64 << 20        # a half-sent frame longer than this is not completed: plain EOF


# A transport's life, in one table (as the communicator's LIFECYCLE): OPEN until something
# breaks it or it closes; BROKEN once it has a reason (ABORT frames not yet sent); SILENT once
# the peers were told, or must not be (a sever: to them, a crash); CLOSED at the end (a BYE
# first only when closed from OPEN).
OPEN, BROKEN, SILENT, CLOSED = "open", "broken", "silent", "closed"
MOVES = {OPEN: {BROKEN, SILENT, CLOSED}, BROKEN: {SILENT, CLOSED}, SILENT: {CLOSED}, CLOSED: set()}


class SharedState:
    """What a transport and its subsets share: the sockets' lock, its state and the failure."""

    def __init__(self) -> None:
        self.state = OPEN
        self.aborted: str | None = None           # why it broke (set with the move to BROKEN)
        self.failure: CommError | None = None     # the error that broke the transport
        self.partial: dict[Conn, int] = {}        # bytes left of half-sent frames
        self.lock = threading.Lock()              # held by exchange and by the ABORT sender
        self.wake_r, self.wake_w = os.pipe()      # wakes an exchange when abort() is called
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.tasks = spin.RunnableTasks()         # whether a step may poll (transport/spin.py)

    def move(self, to: str) -> bool:
        """Go to state ``to`` if the table allows it from here; whether it did."""
        if to not in MOVES[self.state]:
            return False
        self.state = to
        return True

    def broken(self, reason: str) -> None:
        """Keep the first reason; OPEN -> BROKEN."""
        if self.aborted is None:
            self.aborted = reason
        self.move(BROKEN)


LIVE: "weakref.WeakSet[FailureHandling]" = weakref.WeakSet()  # transports not yet closed


@atexit.register
def _close_at_exit() -> None:
    """A script that exits without destroy_process_group still says goodbye to its peers."""
    for t in list(LIVE):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class FailureHandling:
    """What a TCP transport does when something goes wrong, and how it says goodbye."""

    def _failed(self, exc: CommError, sends: dict[int, "SendState"]) -> None:
        if self._shared.failure is None:
            self._shared.failure = exc
        self._shared.broken(str(exc))
        self._shared.partial = {self.conns[p]: q.partial() for p, q in sends.items() if q.partial()}

    # -- watching connections a step does not use ----------------------------------------
    def _peek(self, conn: Conn, what: str) -> None:
        """A peer this step does not receive from sent something: if it is a frame of this
        collective that does not match it, or of an earlier one, the ranks called different
        collectives (e.g. all_reduce here, broadcast there, each waiting for the other)."""
        try:
            conn.fill()
        except EOFError:
            return self._inspect(conn, what)
        except OSError:
            return
        peer = conn.peer
        nxt = next_frame(conn, self._rank_of(self.rank), self._rank_of(peer), what)
        if nxt is None:
            return
        got = nxt.header
        if got.kind != DATA:
            return self._inspect(conn, what)
        cur = self._cur
        if cur is not None and got.sig != cur and got.sig.seq <= cur.seq:
            raise MismatchError(
                f"collective mismatch: rank {self._rank_of(self.rank)} called {cur.describe()} but rank "
                f"{self._rank_of(peer)} called {got.sig.describe()}", op=cur.op, seq=cur.seq,
                rank=self._rank_of(self.rank), peer=self._rank_of(peer))

    def _inspect(self, conn: Conn, what: str) -> None:
        """A connection this step does not use hung up: find out why, without consuming.

        Frames already read ahead stay for later steps. An ABORT raises now; a BYE means the
        peer left cleanly; a bare end of stream starts the dead-peer grace period. When the
        read-ahead buffer fills before the end can be seen, it is left to the step that
        reads this connection.
        """
        conn.watch = False
        try:
            while not conn.eof and not (conn.rpos == 0 and conn.rend == len(conn.rbuf)):
                if conn.fill() == 0:
                    break
        except EOFError:
            pass
        except OSError:
            conn.eof = True
        peer = conn.peer
        try:   # the first control frame read ahead, past the data frames before it
            ctrl = next((f for f in frames(conn.rbuf, conn.rpos, conn.rend) if f.header.kind != DATA), None)
        except ProtocolError as exc:
            raise garbage(self._rank_of(self.rank), self._rank_of(peer), what, exc) from None
        if ctrl is not None:
            if ctrl.header.kind == BYE:
                conn.bye = True
                return
            reason = control_reason(conn.rbuf, ctrl, conn.rend, conn.eof)
            if reason is not None:
                raise control_error(ctrl.header, reason, self._rank_of(self.rank), self._rank_of(peer), what)
        if conn.eof and not conn.bye:
            conn.eof_at = time.monotonic()

    # -- errors --------------------------------------------------------------------------
    def _aborted_error(self, what: str) -> PeerClosedError:
        f = self._shared.failure
        exc = PeerClosedError(f"{what}: rank {self._rank_of(self.rank)}: process group was aborted ({self.aborted})",
                              rank=self._rank_of(self.rank), peer=f.peer if f is not None else -1)
        if f is not None:
            exc.origin, exc.root_cause = f.origin, f.root_cause
        return exc

    def _eof_error(self, peer: int, what: str, st: RecvState | None) -> PeerClosedError:
        where = ""
        if st is not None and st.total:
            where = (f" (it had sent {st.done + (st.off if st.cur is not None else 0)} of "
                     f"{st.total} bytes of this step)")
        me, them = self._rank_of(self.rank), self._rank_of(peer)
        return death_error(what, me, them, f"closed its connection to rank {me} without a goodbye: rank "
                                           f"{them} died (killed or crashed) or lost its network{where}")

    def _reset_error(self, peer: int, what: str, err: OSError) -> PeerClosedError:
        exc = PeerClosedError(f"{what}: the connection from rank {self._rank_of(self.rank)} to rank "
                              f"{self._rank_of(peer)} failed "
                              f"({err.strerror or err}): rank {self._rank_of(peer)} died or aborted",
                              rank=self._rank_of(self.rank), peer=self._rank_of(peer))
        exc.origin = self._rank_of(peer)
        return exc

    def _timeout(self, sends: dict, recvs: dict, what: str) -> CommTimeoutError:
        parts = []
        for peer, st in recvs.items():
            got = st.done + (st.off if st.cur is not None else 0)
            f = st.cur or (st.frames[0] if st.frames else None)
            detail = ""
            if f is not None:
                done = st.off if st.cur is not None else 0
                detail = (f" (frame step {f.expect.step} segment {f.expect.seg}: {done} of "
                          f"{len(f.dest)} bytes, {len(st.frames)} more frames)")
            parts.append(f"received {got} of {st.total} bytes from rank {self._rank_of(peer)}{detail}")
        for peer, q in sends.items():
            parts.append(f"rank {self._rank_of(peer)} has not yet accepted {q.left()} of "
                         f"{sum(len(b) for b in q.bufs)} bytes sent to it")
        peer = next(iter(recvs), next(iter(sends), -1))
        return timeout_error(what, self._rank_of(self.rank), self._rank_of(peer), "", parts)

    # -- lifecycle ---------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Tell every peer why this rank stops (ABORT frame), then shut every socket down.

        Called from another thread while an exchange runs, it wakes that exchange (which
        then fails) and sends once the exchange has let go of the sockets.
        """
        if self._shared.state is CLOSED:
            return
        self._shared.broken(reason)
        try:
            os.write(self._shared.wake_w, b"x")
        except OSError:
            pass
        if self._shared.lock.acquire(timeout=2 * ABORT_GRACE + 1.0):
            try:
                self._send_abort(reason)
            finally:
                self._shared.lock.release()
        self._shutdown_all()

    def sever(self, reason: str) -> None:
        """Fault injection: drop every connection with no ABORT and no BYE (a crash, to peers)."""
        if self._shared.state is CLOSED:
            return
        self._shared.broken(reason)
        self._shared.move(SILENT)
        try:
            os.write(self._shared.wake_w, b"x")
        except OSError:
            pass
        self._shutdown_all()

    def _send_abort(self, reason: str) -> None:
        if not self._shared.move(SILENT):     # told already (or severed, or closed)
            return
        f = self._shared.failure
        if f is None:
            me = self._rank_of(self.rank)
            frame = control_frame(ABORT, f"rank {me}: {reason}", me, "PeerClosedError")
        else:
            origin = f.origin if f.origin >= 0 else self._rank_of(self.rank)
            frame = control_frame(ABORT, f.root_cause or str(f), origin, type(f).__name__)
        out: dict[int, list] = {}
        for peer, conn in self.conns.items():
            if conn.eof or conn.bye:
                continue
            pad = self._shared.partial.get(conn, 0)
            if pad > MAX_PAD or pad < 0:   # (-1: interrupted mid-send, the stream's place unknown)
                continue
            out[peer] = [memoryview(bytes(pad)), memoryview(frame)] if pad else [memoryview(frame)]
        deadline = time.monotonic() + ABORT_GRACE
        sink = bytearray(READ_AHEAD)
        while out and time.monotonic() < deadline:
            poller = select.poll()
            for peer in list(out):
                conn, bufs = self.conns[peer], out[peer]
                try:
                    n = conn.sock.sendmsg(bufs)
                    while n and bufs:
                        k = min(n, len(bufs[0]))
                        bufs[0] = bufs[0][k:]
                        n -= k
                        if not len(bufs[0]):
                            bufs.pop(0)
                    if not bufs:
                        del out[peer]
                        continue
                    # Keep reading (and dropping) what the peer sends, so that two ranks
                    # writing to each other cannot block each other's goodbye.
                    while conn.sock.recv_into(sink):
                        pass
                    del out[peer]  # the peer closed: nobody is left to tell
                except BlockingIOError:
                    poller.register(conn.fd, select.POLLOUT | select.POLLIN)
                except OSError:
                    del out[peer]
            if out:
                poller.poll(10)

    def _shutdown_all(self) -> None:
        for c in self.conns.values():
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._shared.state is CLOSED or not self._owner:
            return
        locked = self._shared.lock.acquire(timeout=1.0)  # an exchange still running fails on EBADF
        try:
            said_goodbye = self._shared.state is OPEN
            self._shared.move(CLOSED)
            if said_goodbye:
                bye = control_frame(BYE)
                for c in self.conns.values():
                    try:
                        c.sock.send(bye)
                    except OSError:
                        pass
            sink = bytearray(READ_AHEAD)
            for c in self.conns.values():
                try:
                    c.sock.shutdown(socket.SHUT_WR)
                    # Unread bytes at close() would turn our FIN into a reset, which can
                    # discard the BYE before the peer reads it: drain what has arrived.
                    for _ in range(64):
                        if not c.sock.recv_into(sink):
                            break
                except OSError:
                    pass
                c.sock.close()
            self.conns = {}
            os.close(self._shared.wake_r)
            os.close(self._shared.wake_w)
            self._shared.tasks.close()
        finally:
            if locked:
                self._shared.lock.release()
        LIVE.discard(self)
