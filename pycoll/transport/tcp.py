"""TCP transport: one non-blocking socket per peer, driven by a poll loop per step.

``exchange`` posts every send and receive of a schedule step and progresses them all in
one thread until done: sends go out with ``sendmsg`` straight from tensor memory (header
and payload as one scatter-gather call, no copy), payloads are read with ``recv_into``
straight into their destination. Headers are parsed from a small per-connection
read-ahead buffer, so a small frame costs one ``recv`` call; bytes of a later frame that
arrive early stay in that buffer for the next step. Because sends and receives progress
together, a step where every rank sends and receives at once cannot deadlock on full
socket buffers. Every wait has the collective's deadline.
"""

from __future__ import annotations

import select
import socket
import time
from collections import deque
from typing import Sequence

from ..errors import CommTimeoutError, PeerClosedError
from ..wire import decode_header, header_length
from .base import InFrame, OutFrame, Transport, check_header

READ_AHEAD = 64 << 10
IOV_BATCH = 64
_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL


class Conn:
    """One peer's socket plus its read-ahead buffer."""

    __slots__ = ("sock", "fd", "peer", "rbuf", "rpos", "rend", "label")

    def __init__(self, sock: socket.socket, peer: int, label: str = "") -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.fd, self.peer, self.label = sock, sock.fileno(), peer, label
        self.rbuf = memoryview(bytearray(READ_AHEAD))
        self.rpos = self.rend = 0

    def fill(self) -> int:
        """Read what is available into the read-ahead buffer; 0 means would block. EOF raises."""
        if self.rpos == self.rend:
            self.rpos = self.rend = 0
        elif self.rend == len(self.rbuf):
            n = self.rend - self.rpos
            self.rbuf[:n] = self.rbuf[self.rpos:self.rend]
            self.rpos, self.rend = 0, n
        try:
            n = self.sock.recv_into(self.rbuf[self.rend:])
        except BlockingIOError:
            return 0
        if n == 0:
            raise EOFError
        self.rend += n
        return n


class _RecvState:
    __slots__ = ("frames", "cur", "off")

    def __init__(self) -> None:
        self.frames: deque[InFrame] = deque()
        self.cur: InFrame | None = None  # frame whose header is parsed, payload in progress
        self.off = 0


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, rank: int, world: int, socks: dict[int, socket.socket]) -> None:
        self.rank, self.world = rank, world
        self.conns = {peer: Conn(s, peer) for peer, s in socks.items()}
        self.aborted: str | None = None

    # -- data path ---------------------------------------------------------------------
    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        if self.aborted is not None:
            raise PeerClosedError(f"{what}: process group was aborted ({self.aborted})", rank=self.rank)
        sends: dict[int, list] = {}
        for f in outs:
            q = sends.setdefault(f.peer, [[], 0, 0])
            q[0].append(f.header)
            if len(f.payload):
                q[0].append(f.payload)
        recvs: dict[int, _RecvState] = {}
        for f in ins:
            recvs.setdefault(f.peer, _RecvState()).frames.append(f)
        try:
            while sends or recvs:
                progressed = False
                for peer in list(sends):
                    progressed |= self._send_some(peer, sends)
                for peer in list(recvs):
                    progressed |= self._recv_some(peer, recvs)
                if not progressed and (sends or recvs):
                    self._wait(sends, recvs, deadline, what)
        except (EOFError, ConnectionError, OSError) as exc:
            if isinstance(exc, (CommTimeoutError, PeerClosedError)):
                raise
            peer = getattr(exc, "_pycoll_peer", -1)
            reason = "closed the connection" if isinstance(exc, EOFError) else f"failed: {exc}"
            raise PeerClosedError(f"{what}: connection from rank {self.rank} to rank {peer} {reason} "
                                  f"(peer died or aborted)", rank=self.rank, peer=peer) from None

    def _send_some(self, peer: int, sends: dict) -> bool:
        bufs, i, off = sends[peer]
        conn = self.conns[peer]
        iov = [bufs[i][off:] if off else bufs[i]] + bufs[i + 1:i + IOV_BATCH]
        try:
            n = conn.sock.sendmsg(iov)
        except BlockingIOError:
            return False
        except OSError as exc:
            exc._pycoll_peer = peer
            raise
        sent = n
        while n > 0:
            rem = len(bufs[i]) - off
            if n >= rem:
                n -= rem
                i, off = i + 1, 0
            else:
                off += n
                n = 0
        if i == len(bufs):
            del sends[peer]
        else:
            sends[peer][1:] = [i, off]
        return sent > 0

    def _recv_some(self, peer: int, recvs: dict) -> bool:
        st, conn = recvs[peer], self.conns[peer]
        progressed = False
        try:
            while True:
                if st.cur is None:
                    if not st.frames:
                        del recvs[peer]
                        return True
                    avail = conn.rend - conn.rpos
                    if avail >= 4:
                        hlen = header_length(conn.rbuf[conn.rpos:conn.rpos + 4])
                        if avail >= 4 + hlen:
                            got = decode_header(conn.rbuf[conn.rpos + 4:conn.rpos + 4 + hlen])
                            f = st.frames.popleft()
                            check_header(f.expect, got, self.rank, peer)
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
                        raise EOFError
                    st.off += n
                    progressed = True
                    if st.off < len(f.dest):
                        continue
                st.cur = None
                if f.on_done is not None:
                    f.on_done()
        except (EOFError, OSError) as exc:
            exc._pycoll_peer = peer
            raise

    def _wait(self, sends: dict, recvs: dict, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timeout(sends, recvs, what)
        poller = select.poll()
        for peer in sends.keys() | recvs.keys():
            mask = (select.POLLOUT if peer in sends else 0) | (select.POLLIN if peer in recvs else 0)
            poller.register(self.conns[peer].fd, mask)
        try:
            poller.poll(min(left, 1.0) * 1000)
        except InterruptedError:
            pass
        if self.aborted is not None:
            raise PeerClosedError(f"{what}: process group was aborted ({self.aborted})", rank=self.rank)

    def _timeout(self, sends: dict, recvs: dict, what: str) -> CommTimeoutError:
        parts = []
        for peer, st in recvs.items():
            f = st.cur or (st.frames[0] if st.frames else None)
            if f is not None:
                done = st.off if st.cur is not None else 0
                parts.append(f"receiving from rank {peer}: {done} of {len(f.dest)} bytes of step "
                             f"{f.expect.step} segment {f.expect.seg}, {len(st.frames)} more frames")
        for peer, (bufs, i, off) in sends.items():
            left = sum(len(b) for b in bufs[i:]) - off
            parts.append(f"sending to rank {peer}: {left} bytes not yet accepted")
        peer = next(iter(recvs), next(iter(sends), -1))
        return CommTimeoutError(f"{what}: rank {self.rank} timed out waiting for rank {peer} ("
                                + "; ".join(parts) + ")", rank=self.rank, peer=peer)

    # -- lifecycle ---------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        if self.aborted is None:
            self.aborted = reason
        for c in self.conns.values():
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for c in self.conns.values():
            try:
                c.sock.close()
            except OSError:
                pass
        self.conns = {}

