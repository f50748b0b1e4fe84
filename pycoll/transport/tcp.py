"""TCP transport: one non-blocking socket per peer, driven by a poll loop per step.

``exchange`` posts every send and receive of a schedule step and progresses them all in
one thread until done: sends go out with ``sendmsg`` straight from tensor memory (header
and payload as one scatter-gather call, no copy), payloads are read with ``recv_into``
straight into their destination. Headers are parsed from a small per-connection
read-ahead buffer, so a small frame costs one ``recv`` call; bytes of a later frame that
arrive early stay in that buffer for the next step. Because sends and receives progress
together, a step where every rank sends and receives at once cannot deadlock on full
socket buffers. Every wait has the collective's deadline.

Failure handling ("never hang"):
- While waiting, every other connection of the mesh is watched for its peer hanging up
  (POLLRDHUP), not only the ones this step uses: a rank blocked on a live peer still learns
  within milliseconds that some other rank died or aborted.
- A rank that fails sends an ABORT frame (reason, error class, rank where the failure
  started) on every connection before shutting it down, so every rank reports the root
  cause ("rank 2 died", "collective mismatch: ...") rather than "rank 1 closed". A frame
  that was half sent is first completed with zero bytes so the ABORT lands on a frame
  boundary (the failed collective's output is undefined anyway).
- A clean ``close`` sends a BYE frame first (also at interpreter exit). So end of stream
  without BYE or ABORT means the peer died; on a connection this step does not use it is
  acted on after ``DEAD_PEER_GRACE`` seconds, in case the step completes without that peer.
"""

from __future__ import annotations

import atexit
import os
import select
import socket
import threading
import time
import weakref
from collections import deque
from typing import Sequence

from ..errors import CommError, CommTimeoutError, MismatchError, PeerClosedError, ProtocolError
from ..wire import ABORT, BYE, DATA, control_frame, control_payload_length, decode_header, header_length
from .base import InFrame, OutFrame, Transport, check_header, control_error

READ_AHEAD = 64 << 10
IOV_BATCH = 64
DEAD_PEER_GRACE = 1.0     # seconds between an idle connection's EOF and calling its peer dead
ABORT_GRACE = 0.25        # seconds spent delivering ABORT frames before shutting sockets
MAX_PAD = 64 << 20        # a half-sent frame longer than this is not completed: plain EOF
_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
_POLLHANGUP = select.POLLRDHUP | _POLLERR


class Conn:
    """One peer's socket plus its read-ahead buffer and what is known of the peer's end."""

    __slots__ = ("sock", "fd", "peer", "rbuf", "rpos", "rend", "label", "eof", "bye", "watch", "eof_at")

    def __init__(self, sock: socket.socket, peer: int, label: str = "") -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.fd, self.peer, self.label = sock, sock.fileno(), peer, label
        self.rbuf = memoryview(bytearray(READ_AHEAD))
        self.rpos = self.rend = 0
        self.eof = False        # the peer's end of stream (FIN or reset) has been read
        self.bye = False        # a BYE frame is in the read-ahead buffer
        self.watch = True       # watch for hang-up while idle (off once it can tell no more)
        self.eof_at = 0.0       # when an idle EOF without goodbye was seen

    def fill(self) -> int:
        """Read what is available into the read-ahead buffer; 0 means would block. EOF raises."""
        if self.rpos == self.rend:
            self.rpos = self.rend = 0
        elif self.rend == len(self.rbuf):
            if self.rpos == 0:
                return 0  # full: reading into no room would look like end of stream
            n = self.rend - self.rpos
            self.rbuf[:n] = self.rbuf[self.rpos:self.rend]
            self.rpos, self.rend = 0, n
        try:
            n = self.sock.recv_into(self.rbuf[self.rend:])
        except BlockingIOError:
            return 0
        if n == 0:
            self.eof = True
            raise EOFError
        self.rend += n
        return n


class _RecvState:
    __slots__ = ("frames", "cur", "off", "total", "done")

    def __init__(self) -> None:
        self.frames: deque[InFrame] = deque()
        self.cur: InFrame | None = None  # frame whose header is parsed, payload in progress
        self.off = 0
        self.total = 0                   # payload bytes expected from this peer in this step
        self.done = 0                    # ... of which complete frames account for this many


class _SendState:
    __slots__ = ("bufs", "hdr", "i", "off")

    def __init__(self) -> None:
        self.bufs: list = []
        self.hdr: list[bool] = []        # bufs[j] is a frame header
        self.i = self.off = 0

    def partial(self) -> int:
        """Bytes left of a frame that is half sent (0 at a frame boundary)."""
        i, off = self.i, self.off
        if i >= len(self.bufs) or (off == 0 and self.hdr[i]):
            return 0
        n = len(self.bufs[i]) - off
        for j in range(i + 1, len(self.bufs)):
            if self.hdr[j]:
                break
            n += len(self.bufs[j])
        return n

    def left(self) -> int:
        return sum(len(b) for b in self.bufs[self.i:]) - self.off


class _State:
    """What a transport and its subsets share: the sockets' lock and the failure."""

    def __init__(self) -> None:
        self.aborted: str | None = None
        self.failure: CommError | None = None     # the error that broke the transport
        self.partial: dict[Conn, int] = {}        # bytes left of half-sent frames
        self.lock = threading.Lock()              # held by exchange and by the ABORT sender
        self.abort_sent = False
        self.closed = False
        self.wake_r, self.wake_w = os.pipe()      # wakes an exchange when abort() is called
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)


_LIVE: "weakref.WeakSet[TcpTransport]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """A script that exits without destroy_process_group still says goodbye to its peers."""
    for t in list(_LIVE):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, rank: int, world: int, socks: dict[int, socket.socket]) -> None:
        self.rank, self.world = rank, world
        self.conns = {peer: Conn(s, peer) for peer, s in socks.items()}
        self.ranks = list(range(world))           # group rank of each transport rank
        self._st = _State()
        self._owner = True
        self._cur = None  # signature of the collective being exchanged
        _LIVE.add(self)

    def subset(self, ranks: list[int]) -> "TcpTransport":
        """A transport over some of this one's ranks, renumbered 0..len-1, sharing the
        connections (and their read-ahead) and the failure state: used for the host
        leaders of a hierarchy. Errors still name group ranks; only the parent is closed."""
        sub = TcpTransport.__new__(TcpTransport)
        sub.rank, sub.world = ranks.index(self.rank), len(ranks)
        sub.conns = {i: self.conns[r] for i, r in enumerate(ranks) if r != self.rank}
        sub.ranks = [self.ranks[r] for r in ranks]
        sub._st, sub._owner, sub._cur = self._st, False, None
        return sub

    @property
    def aborted(self) -> str | None:
        return self._st.aborted

    def _g(self, r: int) -> int:
        """The group rank of transport rank ``r`` (they differ in a subset), for messages."""
        return self.ranks[r] if 0 <= r < len(self.ranks) else r

    # -- data path ---------------------------------------------------------------------
    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        if self.aborted is not None:
            raise self._aborted_error(what)
        sends: dict[int, _SendState] = {}
        try:
            with self._st.lock:
                try:
                    self._exchange(outs, ins, deadline, what, sends)
                except CommError as exc:
                    self._failed(exc, sends)
                    raise
                except BaseException as exc:
                    self._failed(PeerClosedError(
                        f"{what}: rank {self._g(self.rank)} was interrupted: {type(exc).__name__}: {exc}",
                        rank=self._g(self.rank)), sends)
                    raise
        except CommError:
            raise
        except BaseException:
            # Interrupted mid-step (KeyboardInterrupt, a failing reduction): the streams may
            # stand mid-frame, so this transport must not be used again, and peers must know.
            self.abort(self._st.aborted or "interrupted")
            raise

    def _failed(self, exc: CommError, sends: dict[int, "_SendState"]) -> None:
        if self._st.failure is None:
            self._st.failure = exc
        if self._st.aborted is None:
            self._st.aborted = str(exc)
        self._st.partial = {self.conns[p]: q.partial() for p, q in sends.items() if q.partial()}

    def _exchange(self, outs, ins, deadline, what, sends) -> None:
        for f in outs:
            q = sends.get(f.peer)
            if q is None:
                q = sends[f.peer] = _SendState()
            q.bufs.append(f.header)
            q.hdr.append(True)
            if len(f.payload):
                q.bufs.append(f.payload)
                q.hdr.append(False)
        recvs: dict[int, _RecvState] = {}
        for f in ins:
            st = recvs.get(f.peer)
            if st is None:
                st = recvs[f.peer] = _RecvState()
            st.frames.append(f)
            st.total += len(f.dest)
        active = dict(sends)
        if ins:
            self._cur = ins[0].expect.sig
        elif outs:
            try:
                hdr = bytes(outs[0].header)
                self._cur = decode_header(memoryview(hdr)[4:4 + header_length(hdr[:4])]).sig
            except (ProtocolError, ValueError):  # a damaged frame (fault injection)
                self._cur = None
        peeked: set[int] = set()
        peer = -1
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
                        raise self._aborted_error(what)
                    if not progressed:
                        self._wait(active, recvs, deadline, what, peeked)
                    elif time.monotonic() > deadline:
                        raise self._timeout(active, recvs, what)
        except CommError:
            raise
        except EOFError:
            conn = self.conns.get(peer)
            if conn is not None and conn.rend > conn.rpos:  # e.g. an ABORT behind unread frames
                self._inspect(conn, what)
            raise self._eof_error(peer, what, recvs.get(peer)) from None
        except OSError as exc:
            conn = self.conns.get(peer)
            if conn is not None:  # the peer may have left a reason before it closed
                self._inspect(conn, what)
            raise self._reset_error(peer, what, exc) from None

    def _send_some(self, peer: int, sends: dict) -> bool:
        q = sends[peer]
        bufs, i, off = q.bufs, q.i, q.off
        iov = [bufs[i][off:] if off else bufs[i]] + bufs[i + 1:i + IOV_BATCH]
        try:
            n = self.conns[peer].sock.sendmsg(iov)
        except BlockingIOError:
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
                avail = conn.rend - conn.rpos
                if avail >= 4:
                    hlen = self._header_length(conn, peer, what)
                    if avail >= 4 + hlen:
                        got = self._decode(conn, hlen, peer, what)
                        if got.kind != DATA:
                            if self._control(conn, got, hlen, peer, what):
                                continue  # more bytes of the control frame arrived
                            return progressed
                        f = st.frames.popleft()
                        check_header(f.expect, got, self._g(self.rank), self._g(peer))
                        conn.rpos += 4 + hlen
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

    def _header_length(self, conn: Conn, peer: int, what: str) -> int:
        try:
            return header_length(conn.rbuf[conn.rpos:conn.rpos + 4])
        except ProtocolError as exc:
            raise ProtocolError(f"{what}: rank {self._g(self.rank)} got garbage from rank {self._g(peer)}: {exc}",
                                rank=self._g(self.rank), peer=self._g(peer)) from None

    def _decode(self, conn: Conn, hlen: int, peer: int, what: str):
        try:
            return decode_header(conn.rbuf[conn.rpos + 4:conn.rpos + 4 + hlen])
        except ProtocolError as exc:
            raise ProtocolError(f"{what}: rank {self._g(self.rank)} got garbage from rank {self._g(peer)}: {exc}",
                                rank=self._g(self.rank), peer=self._g(peer)) from None

    def _control(self, conn: Conn, got, hlen: int, peer: int, what: str) -> bool:
        """An ABORT or BYE frame where a data frame was expected: raise once it is complete.

        Returns whether more of it arrived (False: wait for the socket)."""
        if got.kind not in (ABORT, BYE):
            raise ProtocolError(f"{what}: rank {self._g(self.rank)} got a frame of unknown kind {got.kind} "
                                f"from rank {self._g(peer)}", rank=self._g(self.rank), peer=self._g(peer))
        try:
            plen = control_payload_length(got)
        except ProtocolError as exc:
            raise ProtocolError(f"{what}: rank {self._g(peer)}: {exc}", rank=self._g(self.rank), peer=self._g(peer)) from None
        start = conn.rpos + 4 + hlen
        if conn.rend - start >= plen or conn.eof:
            payload = bytes(conn.rbuf[start:min(conn.rend, start + plen)])
            raise control_error(got, payload, self._g(self.rank), self._g(peer), what)
        try:
            return conn.fill() > 0
        except EOFError:
            return True

    def _wait(self, sends: dict, recvs: dict, deadline: float, what: str, peeked: set) -> None:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            raise self._timeout(sends, recvs, what)
        poller = select.poll()
        poller.register(self._st.wake_r, select.POLLIN)
        idle: dict[int, Conn] = {}
        wake = min(left, 1.0)
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
            raise self._aborted_error(what)
        for fd, ev in events:
            conn = idle.get(fd)
            if conn is None:
                continue
            if ev & _POLLHANGUP:
                self._inspect(conn, what)
            elif ev & select.POLLIN:
                peeked.add(conn.peer)
                self._peek(conn, what)
        now = time.monotonic()
        for peer, conn in self.conns.items():
            if conn.eof_at and peer not in recvs and now >= conn.eof_at + DEAD_PEER_GRACE:
                raise self._eof_error(peer, what, None)

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
        if conn.rend - conn.rpos < 4:
            return
        peer = conn.peer
        try:
            hlen = header_length(conn.rbuf[conn.rpos:conn.rpos + 4])
            if conn.rend - conn.rpos < 4 + hlen:
                return
            got = decode_header(conn.rbuf[conn.rpos + 4:conn.rpos + 4 + hlen])
        except ProtocolError as exc:
            raise ProtocolError(f"{what}: rank {self._g(self.rank)} got garbage from rank "
                                f"{self._g(peer)}: {exc}", rank=self._g(self.rank), peer=self._g(peer)) from None
        if got.kind != DATA:
            return self._inspect(conn, what)
        cur = self._cur
        if cur is not None and got.sig != cur and got.sig.seq <= cur.seq:
            raise MismatchError(
                f"collective mismatch: rank {self._g(self.rank)} called {cur.describe()} but rank "
                f"{self._g(peer)} called {got.sig.describe()}", op=cur.op, seq=cur.seq,
                rank=self._g(self.rank), peer=self._g(peer))

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
        pos, peer = conn.rpos, conn.peer
        while conn.rend - pos >= 4:
            try:
                hlen = header_length(conn.rbuf[pos:pos + 4])
                if conn.rend - pos < 4 + hlen:
                    break
                got = decode_header(conn.rbuf[pos + 4:pos + 4 + hlen])
                if got.kind == DATA:
                    pos += 4 + hlen + got.nbytes
                    continue
                plen = control_payload_length(got)
            except ProtocolError as exc:
                raise ProtocolError(f"{what}: rank {self._g(self.rank)} got garbage from rank {self._g(peer)}: {exc}",
                                    rank=self._g(self.rank), peer=self._g(peer)) from None
            if got.kind == BYE:
                conn.bye = True
                return
            start = pos + 4 + hlen
            if conn.rend - start < plen and not conn.eof:
                break
            raise control_error(got, bytes(conn.rbuf[start:min(conn.rend, start + plen)]),
                                self._g(self.rank), self._g(peer), what)
        if conn.eof and not conn.bye:
            conn.eof_at = time.monotonic()

    # -- errors --------------------------------------------------------------------------
    def _aborted_error(self, what: str) -> PeerClosedError:
        f = self._st.failure
        exc = PeerClosedError(f"{what}: rank {self._g(self.rank)}: process group was aborted ({self.aborted})",
                              rank=self._g(self.rank), peer=f.peer if f is not None else -1)
        if f is not None:
            exc.origin, exc.root_cause = f.origin, f.root_cause
        return exc

    def _eof_error(self, peer: int, what: str, st: _RecvState | None) -> PeerClosedError:
        where = ""
        if st is not None and st.total:
            where = (f" (it had sent {st.done + (st.off if st.cur is not None else 0)} of "
                     f"{st.total} bytes of this step)")
        exc = PeerClosedError(f"{what}: rank {self._g(peer)} closed its connection to rank {self._g(self.rank)} "
                              f"without a goodbye: rank {self._g(peer)} died (killed or crashed) or lost "
                              f"its network{where}", rank=self._g(self.rank), peer=self._g(peer))
        exc.origin = self._g(peer)
        return exc

    def _reset_error(self, peer: int, what: str, err: OSError) -> PeerClosedError:
        exc = PeerClosedError(f"{what}: the connection from rank {self._g(self.rank)} to rank {self._g(peer)} failed "
                              f"({err.strerror or err}): rank {self._g(peer)} died or aborted",
                              rank=self._g(self.rank), peer=self._g(peer))
        exc.origin = self._g(peer)
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
            parts.append(f"received {got} of {st.total} bytes from rank {self._g(peer)}{detail}")
        for peer, q in sends.items():
            parts.append(f"rank {self._g(peer)} has not yet accepted {q.left()} of "
                         f"{sum(len(b) for b in q.bufs)} bytes sent to it")
        peer = next(iter(recvs), next(iter(sends), -1))
        return CommTimeoutError(f"{what}: rank {self._g(self.rank)} timed out waiting for rank {self._g(peer)}: "
                                + "; ".join(parts), rank=self._g(self.rank), peer=self._g(peer))

    # -- lifecycle ---------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Tell every peer why this rank stops (ABORT frame), then shut every socket down.

        Called from another thread while an exchange runs, it wakes that exchange (which
        then fails) and sends once the exchange has let go of the sockets.
        """
        if self._st.closed:
            return
        if self._st.aborted is None:
            self._st.aborted = reason
        try:
            os.write(self._st.wake_w, b"x")
        except OSError:
            pass
        if self._st.lock.acquire(timeout=2 * ABORT_GRACE + 1.0):
            try:
                self._send_abort(reason)
            finally:
                self._st.lock.release()
        self._shutdown_all()

    def sever(self, reason: str) -> None:
        """Fault injection: drop every connection with no ABORT and no BYE (a crash, to peers)."""
        if self._st.closed:
            return
        if self._st.aborted is None:
            self._st.aborted = reason
        self._st.abort_sent = True
        try:
            os.write(self._st.wake_w, b"x")
        except OSError:
            pass
        self._shutdown_all()

    def _send_abort(self, reason: str) -> None:
        if self._st.abort_sent or self._st.closed:
            return
        self._st.abort_sent = True
        f = self._st.failure
        if f is None:
            frame = control_frame(ABORT, f"rank {self._g(self.rank)}: {reason}", self._g(self.rank), "PeerClosedError")
        else:
            origin = f.origin if f.origin >= 0 else self._g(self.rank)
            frame = control_frame(ABORT, f.root_cause or str(f), origin, type(f).__name__)
        out: dict[int, list] = {}
        for peer, conn in self.conns.items():
            if conn.eof or conn.bye:
                continue
            pad = self._st.partial.get(conn, 0)
            if pad > MAX_PAD:
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
        if self._st.closed or not self._owner:
            return
        locked = self._st.lock.acquire(timeout=1.0)  # an exchange still running fails on EBADF
        try:
            self._st.closed = True
            if self.aborted is None:
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
            os.close(self._st.wake_r)
            os.close(self._st.wake_w)
        finally:
            if locked:
                self._st.lock.release()
        _LIVE.discard(self)
