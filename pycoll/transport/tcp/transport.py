"""TCP transport, data path: one non-blocking socket per peer, driven by a poll loop per step.

``exchange`` posts every send and receive of a schedule step and progresses them all in
one thread until done: sends go out with ``sendmsg`` straight from tensor memory (header
and payload as one scatter-gather call, no copy), payloads are read with ``recv_into``
straight into their destination. Headers are parsed from a small per-connection
read-ahead buffer (``tcp_conn.Conn``), so a small frame costs one ``recv`` call; bytes of
a later frame that arrive early stay in that buffer for the next step. Because sends and
receives progress together, a step where every rank sends and receives at once cannot
deadlock on full socket buffers. Every wait has the collective's deadline.

A step that finds nothing to do polls its sockets before it blocks in ``poll``, for up to
``spin`` seconds (``PYCOLL_TCP_SPIN_US``, 1000 by default), and only while no other task waits
for a core: ``transport.spin`` decides per step, from the machine's runnable tasks, how the
peers answered the last spins (``AdaptiveSpin``), and the thread (0.1 ms at most in the
group's worker, which runs asynchronous ops while the caller computes). The poll yields the
core at each turn (``sched_yield``), so a thread waiting for it, often the one the peer's
answer depends on, is not kept off it by the spin. A peer's answer then costs no wake-up: on
this VM a wake-up took 50-250 us, which left small all_reduces at 120-300 us in runs where
blocking ranks woke each other late op after op (docs/performance.md).

Failure handling lives in ``failure``: the connections' ``Lifecycle`` (shared with subsets;
abort, sever and close are its), watching idle connections, and the errors a step raises.
``progress()`` says how far the step in progress got, per peer (the hang dump asks).
"""

from __future__ import annotations

import select
import socket
import time
from typing import Sequence

from pycoll.errors import CommError, PeerClosedError, ProtocolError
from pycoll.transport import spin as spinning
from pycoll.transport import waits
from pycoll.transport.base import (
    InFrame,
    OutFrame,
    Transport,
    check_header,
    control_error,
)
from pycoll.transport.frames import control_reason, encoded_header, next_frame
from pycoll.transport.tcp.conn import IOV_BATCH, Conn, RecvState, SendState
from pycoll.transport.tcp import failure
from pycoll.transport.tcp.failure import CLOSED, DEAD_PEER_GRACE, Lifecycle
from pycoll.wire import (
    ABORT,
    BYE,
    DATA,
)

__all__ = ["TcpTransport"]

_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
_POLLHANGUP = select.POLLRDHUP | _POLLERR


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, rank: int, world: int, socks: dict[int, socket.socket]) -> None:
        self.rank, self.world = rank, world
        self.conns = {peer: Conn(s, peer) for peer, s in socks.items()}
        self.ranks = list(range(world))           # group rank of each transport rank
        self._life = Lifecycle(rank, self.conns)
        self._owner = True
        self._cur = None  # signature of the collective being exchanged
        self._progress = None   # (sends, receives) still open in the step in progress
        self.spin = 0.0         # seconds a step may poll before it blocks (set by the group)
        self._spins = None      # spin.SpinPolicy over ``spin``, made at the first step

    def subset(self, ranks: list[int]) -> "TcpTransport":
        """A transport over some of this one's ranks, renumbered 0..len-1, sharing the
        connections (and their read-ahead) and the failure state: used for the host
        leaders of a hierarchy. Errors still name group ranks; only the parent is closed."""
        sub = TcpTransport.__new__(TcpTransport)
        sub.rank, sub.world = ranks.index(self.rank), len(ranks)
        sub.conns = {i: self.conns[r] for i, r in enumerate(ranks) if r != self.rank}
        sub.ranks = [self.ranks[r] for r in ranks]
        sub._life, sub._owner, sub._cur, sub._progress = self._life, False, None, None
        sub.spin, sub._spins = self.spin, None
        return sub

    @property
    def aborted(self) -> str | None:
        return self._life.aborted

    def abort(self, reason: str) -> None:
        """Tell every peer why this rank stops (ABORT), then shut every connection down."""
        self._life.abort(reason)

    def sever(self, reason: str) -> None:
        """Fault injection: drop every connection with no goodbye (a crash, to the peers)."""
        self._life.sever(reason)

    def close(self) -> None:
        """Say goodbye and close the connections (a subset leaves that to its parent)."""
        if self._owner:
            self._life.close()
            self.conns = {}

    def _rank_of(self, r: int) -> int:
        """The group rank of transport rank ``r`` (they differ in a subset), for messages."""
        return self.ranks[r] if 0 <= r < len(self.ranks) else r

    def progress(self) -> str:
        """Bytes done per peer of the step in progress (read from another thread: a snapshot)."""
        state = self._progress
        if state is None:
            return "between transfers (framing or reducing)"
        sends, recvs = state
        parts = []
        for peer, r in list(recvs.items()):
            got = r.done + (r.off if r.cur is not None else 0)
            parts.append(f"waiting for rank {self._rank_of(peer)}: received {got} of {r.total} bytes")
        for peer, q in list(sends.items()):
            total = sum(len(b) for b in q.bufs)
            parts.append(f"sending to rank {self._rank_of(peer)}: {total - q.left()} of {total} bytes "
                         f"(headers included) accepted")
        return "; ".join(parts) or "all transfers of the step done"

    # -- data path ---------------------------------------------------------------------
    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        if self.aborted is not None:
            raise failure.aborted_error(self._life, what)
        if self._life.state is CLOSED:
            me = self._rank_of(self.rank)
            raise CommError(f"{what}: rank {me}'s TCP transport is closed", rank=me)
        sends: dict[int, SendState] = {}
        try:
            with self._life.lock:
                try:
                    self._exchange(outs, ins, deadline, what, sends)
                except CommError as exc:
                    self._failed(exc, sends)
                    raise
                except BaseException as exc:
                    self._failed(PeerClosedError(
                        f"{what}: rank {self._rank_of(self.rank)} was interrupted: {type(exc).__name__}: {exc}",
                        rank=self._rank_of(self.rank)), sends)
                    raise
                finally:
                    self._progress = None
        except CommError:
            raise
        except BaseException:
            # Interrupted mid-step (KeyboardInterrupt, a failing reduction): the streams may
            # stand mid-frame, so this transport must not be used again, and peers must know.
            self.abort(self._life.aborted or "interrupted")
            raise

    def _failed(self, exc: CommError, sends: dict[int, SendState]) -> None:
        self._life.failed(exc, {self.conns[p]: q.partial() for p, q in sends.items() if q.partial()})

    def _names(self, peer: int) -> tuple[int, int]:
        """(this rank, ``peer``) as group ranks, for errors."""
        return self._life.me, self._rank_of(peer)

    def _exchange(self, outs, ins, deadline, what, sends) -> None:
        for f in outs:
            q = sends.get(f.peer)
            if q is None:
                q = sends[f.peer] = SendState()
            q.bufs.append(f.header)
            q.hdr.append(True)
            if len(f.payload):
                q.bufs.append(f.payload)
                q.hdr.append(False)
        recvs: dict[int, RecvState] = {}
        for f in ins:
            st = recvs.get(f.peer)
            if st is None:
                st = recvs[f.peer] = RecvState()
            st.frames.append(f)
            st.total += len(f.dest)
        active = dict(sends)
        self._progress = (active, recvs)
        if ins:
            self._cur = ins[0].expect.sig
        elif outs:
            try:
                self._cur = encoded_header(bytes(outs[0].header)).sig
            except (ProtocolError, ValueError):  # a damaged frame (fault injection)
                self._cur = None
        peeked: set[int] = set()
        peer = -1
        started = time.monotonic()
        spins = self._spins
        if self.spin and (spins is None or spins.full != self.spin):
            spins = self._spins = spinning.SpinPolicy(self.spin, self._life.tasks)
        polling = None if spins is not None else False   # None: decided when a step first waits
        blocked = False
        try:
            while active or recvs:
                progressed = False
                for peer in list(active):
                    progressed |= self._send_some(peer, active)
                for peer in list(recvs):
                    progressed |= self._recv_some(peer, recvs, what)
                peer = -1
                if active or recvs:
                    if self.aborted is not None:
                        raise failure.aborted_error(self._life, what)
                    if not progressed:
                        # Polling past the grace yields the core at each turn: a thread that
                        # waits for it (the peer's wake-up, or a thread it waits for) runs
                        # first; spinning through it stalled ops ~1.3 ms (docs/performance.md).
                        if polling is None:
                            polling = spins.begin(time.monotonic())
                            if polling:
                                continue
                        elif polling:
                            if spins.poll(time.monotonic()):
                                continue
                            polling = False
                        blocked = True
                        self._wait(active, recvs, deadline, what, peeked)
                    elif time.monotonic() > deadline:
                        raise failure.step_timeout(active, recvs, what, self._life.me, self._rank_of)
            # A step that never blocked had its peers in time, whether it had to poll for
            # them or found their frames already there: the next gets the whole budget.
            if spins is not None:
                if blocked:
                    spins.unanswered()
                else:
                    spins.answered()
        except CommError as exc:
            now = time.monotonic()
            better = failure.stuck_elsewhere(exc, recvs, what, self._life.me, self._rank_of,
                                             now - started, deadline - started)
            if better is not None:
                raise better from None
            raise
        except EOFError:
            conn = self.conns.get(peer)
            if conn is not None and conn.rend > conn.rpos:  # e.g. an ABORT behind unread frames
                failure.inspect(conn, what, *self._names(peer))
            raise failure.eof_error(what, *self._names(peer), recvs.get(peer)) from None
        except OSError as exc:
            conn = self.conns.get(peer)
            if conn is not None:  # the peer may have left a reason before it closed
                failure.inspect(conn, what, *self._names(peer))
            raise failure.reset_error(what, *self._names(peer), exc) from None

    def _send_some(self, peer: int, sends: dict) -> bool:
        q = sends[peer]
        bufs, i, off = q.bufs, q.i, q.off
        iov = [bufs[i][off:] if off else bufs[i]] + bufs[i + 1:i + IOV_BATCH]
        q.sending = True
        try:
            n = self.conns[peer].sock.sendmsg(iov)
        except BlockingIOError:
            q.sending = False
            return False
        sent = n
        while n > 0:
            rem = len(bufs[i]) - off
            if n >= rem:
                n -= rem
                i, off = i + 1, 0
            else:
                off += n
                n = 0
        q.i, q.off = i, off
        q.sending = False
        if i == len(bufs):
            del sends[peer]
        return sent > 0

    def _recv_some(self, peer: int, recvs: dict, what: str) -> bool:
        st, conn = recvs[peer], self.conns[peer]
        progressed = False
        while True:
            if st.cur is None:
                if not st.frames:
                    del recvs[peer]
                    return True
                nxt = next_frame(conn, self._rank_of(self.rank), self._rank_of(peer), what)
                if nxt is not None:
                    got = nxt.header
                    if got.kind != DATA:
                        if self._control(conn, nxt, peer, what):
                            continue  # more bytes of the control frame arrived
                        return progressed
                    f = st.frames.popleft()
                    check_header(f.expect, got, self._rank_of(self.rank), self._rank_of(peer))
                    conn.rpos = nxt.start
                    st.cur, st.off = f, 0
                    progressed = True
                    # Payload bytes already read ahead are copied out first.
                    take = min(conn.rend - conn.rpos, len(f.dest))
                    if take:
                        f.dest[:take] = conn.rbuf[conn.rpos:conn.rpos + take]
                        conn.rpos += take
                        st.off = take
                    continue
                if conn.fill() == 0:
                    return progressed
                progressed = True
                continue
            f = st.cur
            if st.off < len(f.dest):
                try:
                    n = conn.sock.recv_into(f.dest[st.off:])
                except BlockingIOError:
                    return progressed
                if n == 0:
                    conn.eof = True
                    raise EOFError
                st.off += n
                progressed = True
                if st.off < len(f.dest):
                    continue
            st.cur = None
            st.done += len(f.dest)
            if f.on_done is not None:
                f.on_done()

    def _control(self, conn: Conn, nxt, peer: int, what: str) -> bool:
        """An ABORT or BYE frame where a data frame was expected: raise once it is complete.

        Returns whether more of it arrived (False: wait for the socket)."""
        if nxt.header.kind not in (ABORT, BYE):
            raise ProtocolError(f"{what}: rank {self._rank_of(self.rank)} got a frame of unknown kind "
                                f"{nxt.header.kind} from rank {self._rank_of(peer)}", rank=self._rank_of(self.rank),
                                peer=self._rank_of(peer))
        reason = control_reason(conn.rbuf, nxt, conn.rend, conn.eof)
        if reason is not None:
            raise control_error(nxt.header, reason, self._rank_of(self.rank), self._rank_of(peer), what)
        try:
            return conn.fill() > 0
        except EOFError:
            return True

    def _wait(self, sends: dict, recvs: dict, deadline: float, what: str, peeked: set) -> None:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            raise failure.step_timeout(sends, recvs, what, self._life.me, self._rank_of)
        poller = select.poll()
        poller.register(self._life.wake_r, select.POLLIN)
        idle: dict[int, Conn] = {}
        wake = min(left, 1.0, waits.due(now))
        for peer, conn in self.conns.items():
            mask = (select.POLLOUT if peer in sends else 0) | (select.POLLIN if peer in recvs else 0)
            if peer not in recvs:
                if conn.eof_at:
                    wake = min(wake, max(0.0, conn.eof_at + DEAD_PEER_GRACE - now))
                elif conn.watch:
                    mask |= select.POLLRDHUP | (0 if peer in peeked else select.POLLIN)
                    idle[conn.fd] = conn
            if mask:
                poller.register(conn.fd, mask)
        try:
            events = poller.poll(wake * 1000)
        except InterruptedError:
            events = []
        if self.aborted is not None:
            raise failure.aborted_error(self._life, what)
        for fd, ev in events:
            conn = idle.get(fd)
            if conn is None:
                continue
            if ev & _POLLHANGUP:
                failure.inspect(conn, what, *self._names(conn.peer))
            elif ev & select.POLLIN:
                peeked.add(conn.peer)
                failure.peek(conn, self._cur, what, *self._names(conn.peer))
        now = time.monotonic()
        for peer, conn in self.conns.items():
            if conn.eof_at and peer not in recvs and now >= conn.eof_at + DEAD_PEER_GRACE:
                raise failure.eof_error(what, *self._names(peer), None)

