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

``Lifecycle`` is what a transport and its subsets (a hierarchy's host leaders) share: the
connections, the sockets' lock, the state in one table, the failure; and the three ways that
life ends (``abort``, ``sever``, ``close``). Watching a connection and forming a step's errors
are functions of the connection and the group ranks they name; ``tcp.transport`` (the data
path) holds a ``Lifecycle`` and calls them.
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
from pycoll.transport.tcp.conn import READ_AHEAD, Conn, RecvState
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

LIVE: "weakref.WeakSet[Lifecycle]" = weakref.WeakSet()  # transports not yet closed


@atexit.register
def _close_at_exit() -> None:
    """A script that exits without destroy_process_group still says goodbye to its peers."""
    for life in list(LIVE):
        try:
            life.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class Lifecycle:
    """The connections of a transport (``conns``: peer -> Conn, all of them), their state and
    the failure that broke them; ``me`` is this rank's group rank (ABORT frames name it)."""

    def __init__(self, me: int, conns: dict[int, Conn]) -> None:
        self.me, self.conns = me, conns
        self.state = OPEN
        self.aborted: str | None = None           # why it broke (set with the move to BROKEN)
        self.failure: CommError | None = None     # the error that broke the transport
        self.partial: dict[Conn, int] = {}        # bytes left of half-sent frames
        self.lock = threading.Lock()              # held by exchange and by the ABORT sender
        self.wake_r, self.wake_w = os.pipe()      # wakes an exchange when abort() is called
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.tasks = spin.RunnableTasks()         # whether a step may poll (transport/spin.py)
        LIVE.add(self)

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

    def failed(self, exc: CommError, partial: dict[Conn, int]) -> None:
        """A step failed with ``exc``, leaving ``partial`` (conn -> bytes left of a half-sent
        frame) for the ABORT frames to complete first."""
        if self.failure is None:
            self.failure = exc
        self.broken(str(exc))
        self.partial = partial

    def abort(self, reason: str) -> None:
        """Tell every peer why this rank stops (ABORT frame), then shut every socket down.

        Called from another thread while an exchange runs, it wakes that exchange (which
        then fails) and sends once the exchange has let go of the sockets.
        """
        if self.state is CLOSED:
            return
        self.broken(reason)
        self._wake()
        if self.lock.acquire(timeout=2 * ABORT_GRACE + 1.0):
            try:
                self._send_abort(reason)
            finally:
                self.lock.release()
        self._shutdown_all()

    def sever(self, reason: str) -> None:
        """Fault injection: drop every connection with no ABORT and no BYE (a crash, to peers)."""
        if self.state is CLOSED:
            return
        self.broken(reason)
        self.move(SILENT)
        self._wake()
        self._shutdown_all()

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _send_abort(self, reason: str) -> None:
        if not self.move(SILENT):     # told already (or severed, or closed)
            return
        f = self.failure
        if f is None:
            frame = control_frame(ABORT, f"rank {self.me}: {reason}", self.me, "PeerClosedError")
        else:
            origin = f.origin if f.origin >= 0 else self.me
            frame = control_frame(ABORT, f.root_cause or str(f), origin, type(f).__name__)
        out: dict[int, list] = {}
        for peer, conn in self.conns.items():
            if conn.eof or conn.bye:
                continue
            pad = self.partial.get(conn, 0)
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
        """Say goodbye (BYE, when still OPEN) and close every socket; at most once."""
        if self.state is CLOSED:
            return
        locked = self.lock.acquire(timeout=1.0)  # an exchange still running fails on EBADF
        try:
            said_goodbye = self.state is OPEN
            self.move(CLOSED)
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
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.tasks.close()
        finally:
            if locked:
                self.lock.release()
        LIVE.discard(self)


# -- watching connections a step does not use ------------------------------------------------
def peek(conn: Conn, cur, what: str, me: int, them: int) -> None:
    """A peer this step does not receive from (group rank ``them``) sent something: if it is a
    frame of this collective (signature ``cur``) that does not match it, or of an earlier
    one, the ranks called different collectives (e.g. all_reduce here, broadcast there, each
    waiting for the other)."""
    try:
        conn.fill()
    except EOFError:
        return inspect(conn, what, me, them)
    except OSError:
        return
    nxt = next_frame(conn, me, them, what)
    if nxt is None:
        return
    got = nxt.header
    if got.kind != DATA:
        return inspect(conn, what, me, them)
    if cur is not None and got.sig != cur and got.sig.seq <= cur.seq:
        raise MismatchError(
            f"collective mismatch: rank {me} called {cur.describe()} but rank {them} called "
            f"{got.sig.describe()}", op=cur.op, seq=cur.seq, rank=me, peer=them)


def inspect(conn: Conn, what: str, me: int, them: int) -> None:
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
    try:   # the first control frame read ahead, past the data frames before it
        ctrl = next((f for f in frames(conn.rbuf, conn.rpos, conn.rend) if f.header.kind != DATA), None)
    except ProtocolError as exc:
        raise garbage(me, them, what, exc) from None
    if ctrl is not None:
        if ctrl.header.kind == BYE:
            conn.bye = True
            return
        reason = control_reason(conn.rbuf, ctrl, conn.rend, conn.eof)
        if reason is not None:
            raise control_error(ctrl.header, reason, me, them, what)
    if conn.eof and not conn.bye:
        conn.eof_at = time.monotonic()


# -- the errors a step raises ----------------------------------------------------------------
def aborted_error(life: Lifecycle, what: str) -> PeerClosedError:
    """A step on a transport that was aborted (or broke in an earlier step)."""
    f = life.failure
    exc = PeerClosedError(f"{what}: rank {life.me}: process group was aborted ({life.aborted})",
                          rank=life.me, peer=f.peer if f is not None else -1)
    if f is not None:
        exc.origin, exc.root_cause = f.origin, f.root_cause
    return exc


def eof_error(what: str, me: int, them: int, st: RecvState | None) -> PeerClosedError:
    """Rank ``them`` closed its connection with no goodbye (``st``: what this step had of it)."""
    where = ""
    if st is not None and st.total:
        where = (f" (it had sent {st.done + (st.off if st.cur is not None else 0)} of "
                 f"{st.total} bytes of this step)")
    return death_error(what, me, them, f"closed its connection to rank {me} without a goodbye: rank "
                                       f"{them} died (killed or crashed) or lost its network{where}")


def reset_error(what: str, me: int, them: int, err: OSError) -> PeerClosedError:
    exc = PeerClosedError(f"{what}: the connection from rank {me} to rank {them} failed "
                          f"({err.strerror or err}): rank {them} died or aborted", rank=me, peer=them)
    exc.origin = them
    return exc


def stuck_elsewhere(exc: CommError, recvs: dict, what: str, me: int, rank_of, waited: float,
                    budget: float) -> CommTimeoutError | None:
    """A better account than a relayed timeout, or None. When a peer's timeout reaches this
    rank (its ABORT) while this rank has spent most of its own step's budget waiting for
    another peer, the chain leads there: in a ring where rank 2's link is down, rank 1 times
    out waiting for rank 0, which waits for rank 2; relayed as is, rank 0 would say only
    that rank 1 gave up on it. A rank that came late (little of its budget waited) relays."""
    if not isinstance(exc, CommTimeoutError) or exc.root_cause is None or waited < 0.5 * budget:
        return None
    sender = exc.peer
    stuck = {p: st for p, st in recvs.items() if rank_of(p) != sender}
    if not stuck:
        return None
    base = step_timeout({}, stuck, what, me, rank_of)
    peer = base.peer
    text = str(base).replace(f"rank {me} timed out waiting for rank {peer}",
                             f"rank {me} had waited {waited:.1f} s for rank {peer} when rank "
                             f"{sender} timed out", 1)
    out = CommTimeoutError(f"{text}; rank {sender}'s reason: {exc.root_cause}",
                           op=exc.op, seq=exc.seq, rank=me, peer=peer)
    out.origin, out.root_cause = peer, exc.root_cause
    return out


def step_timeout(sends: dict, recvs: dict, what: str, me: int, rank_of) -> CommTimeoutError:
    """The step's deadline passed: what it still had to receive and send, per peer
    (``rank_of``: a transport rank's group rank)."""
    parts = []
    for peer, st in recvs.items():
        got = st.done + (st.off if st.cur is not None else 0)
        f = st.cur or (st.frames[0] if st.frames else None)
        detail = ""
        if f is not None:
            done = st.off if st.cur is not None else 0
            detail = (f" (frame step {f.expect.step} segment {f.expect.seg}: {done} of "
                      f"{len(f.dest)} bytes, {len(st.frames)} more frames)")
        parts.append(f"received {got} of {st.total} bytes from rank {rank_of(peer)}{detail}")
    for peer, q in sends.items():
        parts.append(f"rank {rank_of(peer)} has not yet accepted {q.left()} of "
                     f"{sum(len(b) for b in q.bufs)} bytes sent to it")
    peer = next(iter(recvs), next(iter(sends), -1))
    return timeout_error(what, me, rank_of(peer), "", parts)
