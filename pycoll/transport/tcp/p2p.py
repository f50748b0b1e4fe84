"""Point-to-point engine: send/recv with tags and any-source receive, on dedicated sockets.

One progress thread per group serves the point-to-point sockets (separate from the
collective sockets, so an unmatched large ``isend`` never blocks a collective). It always
reads: a frame that matches a posted receive (same source or any source, same tag, in
posting order) is read straight into that receive's tensor; one that matches nothing yet
is kept as an unexpected message until a receive claims it (MPI's eager protocol). Sends
to a peer go out in posting order: one with nothing queued before it is written by the
caller's thread as far as the socket takes it, the rest by the progress thread. So
``isend``/``irecv`` pairs in any order, rings of blocking sends and batch_isend_irecv all
complete without deadlock.

Memory is bounded: unexpected messages may hold at most ``PYCOLL_MAX_UNEXPECTED_BYTES``
(default 1 GiB) in all; a header claiming more is a protocol error for that peer, raised
before anything is allocated. A frame drained because it does not fit the receive that
matched it is read through a small fixed buffer, never allocated whole.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from collections import deque

from pycoll import callbacks, settings
from pycoll.errors import CommError, CommTimeoutError, PeerClosedError, ProtocolError
from pycoll.transport.base import control_error
from pycoll.transport.frames import control_reason, next_frame
from pycoll.transport.tcp.p2p_requests import ANY, Discard, Incoming, Request, size_error, too_big, write
from pycoll.transport.tcp.conn import Conn
from pycoll.wire import (
    ABORT,
    BYE,
    DATA,
    Header,
    Signature,
    control_frame,
)

log = logging.getLogger("pycoll")

MAX_POLL_S = 60.0   # the progress thread's longest sleep: poll() takes int milliseconds
MAX_UNEXPECTED_BYTES = settings.get("PYCOLL_MAX_UNEXPECTED_BYTES")


class P2PEngine:
    def __init__(self, rank: int, world: int, socks: dict[int, socket.socket],
                 runner: callbacks.Runner | None = None) -> None:
        self.rank, self.world = rank, world
        self._own_runner = runner is None
        runner = runner or callbacks.Runner(f"pycoll-callbacks-{rank}")
        self._runner = runner
        self.conns = {p: Conn(s, p) for p, s in socks.items()}
        self._lock = threading.Lock()
        self._sends: dict[int, deque[Request]] = {p: deque() for p in socks}
        self._posted: list[Request] = []
        self._unexpected: deque[tuple[int, int, Header, memoryview]] = deque()  # (order, peer, hdr, data)
        self._reading: dict[int, Incoming] = {}
        self._order = itertools.count()
        self._unexpected_bytes = 0
        self.max_unexpected = MAX_UNEXPECTED_BYTES
        self._dead: dict[int, str] = {}
        self._left: set[int] = set()         # peers that said BYE: gone, but not dead
        self._what = {p: f"point-to-point with rank {p}" for p in socks}   # error labels
        self._finished: list[Request] = []   # finished under the lock, on_done not yet called
        self._broken: BaseException | None = None  # the progress thread died of it
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        if self.conns:
            self._thread = callbacks.start_thread(self._loop, self._thread_failed, f"pycoll-p2p-{rank}", runner)

    # -- API ---------------------------------------------------------------------------
    def isend(self, peer: int, tag: int, buf: memoryview, dtype: str, numel: int, deadline: float,
              on_done=None) -> Request:
        req = Request("send", peer, tag, Signature("p2p", tag, dtype, numel), buf, deadline, on_done)
        req.header = Header(DATA, req.sig, 0, 0, len(buf)).encode()
        with self._lock:
            if not self._refuse(req):
                if not self._sends[peer] and self._send_now(req):
                    self._finish(req)
                else:
                    self._sends[peer].append(req)
                    req = None
        if req is None:
            self._wake()
        else:
            self._run_finished()
        return req

    def _send_now(self, req: Request) -> bool:
        """With nothing queued to the peer, send in the caller's thread as far as the socket
        takes it (call holding the lock): True when all of it went. A handoff to the
        progress thread costs a wake-up, and waits for the GIL as long as the caller keeps
        it (docs/performance.md, "point-to-point")."""
        try:
            return write(self.conns[req.peer].sock, req)
        except OSError:   # full (BlockingIOError), or broken: the progress thread takes over
            return False

    def irecv(self, peer: int, tag: int, buf: memoryview, dtype: str, numel: int, deadline: float,
              on_done=None) -> Request:
        req = Request("recv", peer, tag, Signature("p2p", tag, dtype, numel), buf, deadline, on_done)
        posted = False
        with self._lock:
            if not self._refuse(req):
                for item in self._unexpected:
                    _, src, hdr, data = item
                    if (peer in (ANY, src)) and hdr.sig.seq == tag:
                        self._unexpected.remove(item)
                        self._unexpected_bytes -= len(data)
                        self._complete_recv(req, src, hdr, data)
                        break
                else:
                    if peer != ANY and peer in self._dead:
                        self._finish(req, self._dead_error(req, peer))
                    else:
                        self._posted.append(req)
                        posted = True
        if posted:
            self._wake()
        else:
            self._run_finished()
        return req

    def _refuse(self, req: Request) -> bool:
        """Finish ``req`` at once (call holding the lock) if it cannot be served: the engine
        is closed or broken, or (a send) its peer is gone."""
        if self._closed:
            error = PeerClosedError(f"rank {self.rank}: {req.describe()}: process group destroyed",
                                    op=req.kind, seq=req.tag, rank=self.rank, peer=req.peer)
        elif self._broken is not None:
            error = PeerClosedError(f"rank {self.rank}: {req.describe()}: point-to-point engine failed: "
                                    f"{type(self._broken).__name__}: {self._broken}",
                                    op=req.kind, seq=req.tag, rank=self.rank, peer=req.peer)
        elif req.kind == "send" and req.peer in self._dead:
            error = self._dead_error(req, req.peer)
        else:
            return False
        self._finish(req, error)
        return True

    def dead_peers(self) -> dict[int, str]:
        """Peers whose connection ended or failed without a goodbye, and how (read by a
        shrink's watch: a peer that destroyed its group cleanly is not among them)."""
        return {p: why for p, why in self._dead.items() if p not in self._left}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        half_sent = {p for p, q in self._sends.items() if q and q[0].off}   # no BYE inside a frame
        self._fail_all(PeerClosedError(f"rank {self.rank}: process group destroyed", rank=self.rank))
        for p, c in self.conns.items():
            # A goodbye: a peer still watching this connection (a shrink) knows it left, not died.
            if p not in self._dead and p not in half_sent:
                try:
                    c.sock.send(control_frame(BYE, "", self.rank))
                except OSError:
                    pass
            c.sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._own_runner:
            self._runner.close()

    def pending(self) -> list[str]:
        """The requests not finished yet, described (a snapshot, for the hang dump)."""
        with self._lock:
            reqs = list(self._posted) + [r for q in self._sends.values() for r in q]
        return [r.describe() for r in reqs if not r.done.is_set()]

    # -- finishing requests ----------------------------------------------------------------
    def _finish(self, req: Request, error: BaseException | None = None) -> None:
        """Finish ``req`` (call holding the lock); its on_done runs in _run_finished."""
        if req.done.is_set():
            return
        req.error = error
        req.done.set()
        if req.on_done is not None:
            self._finished.append(req)

    def _run_finished(self) -> None:
        """Call the on_done of every request finished so far, holding no lock (they complete
        Works, whose future callbacks may post more requests)."""
        if not self._finished:
            return
        with self._lock:
            done, self._finished = self._finished, []
        for req in done:
            try:
                req.on_done(req)
            except Exception:  # noqa: BLE001 - one request's write-back must not stop the rest
                log.exception("pycoll rank %d: completing %s failed", self.rank, req.describe())

    def _thread_failed(self, exc: BaseException) -> None:
        """The progress thread died of ``exc``: fail every request, now and later."""
        with self._lock:
            self._broken = exc
        self._fail_all(PeerClosedError(f"rank {self.rank}: point-to-point engine failed: "
                                       f"{type(exc).__name__}: {exc}", rank=self.rank))

    # -- progress thread ---------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _loop(self) -> None:
        while not self._closed:
            with self._lock:
                poller = select.poll()
                poller.register(self._wake_r, select.POLLIN)
                for p, c in self.conns.items():
                    if p not in self._dead:
                        poller.register(c.fd, select.POLLIN | (select.POLLOUT if self._sends[p] else 0))
                timeout = self._next_deadline()
            # Bounded slices: a deadline days away must not overflow poll's int milliseconds.
            poller.poll(MAX_POLL_S * 1000 if timeout is None else max(0.0, min(timeout, MAX_POLL_S)) * 1000)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            with self._lock:
                for p in list(self.conns):
                    if p in self._dead:
                        continue
                    try:
                        try:
                            self._progress_send(p)
                        except OSError:
                            self._progress_recv(p)   # the peer may have said why it stopped
                            raise
                        self._progress_recv(p)
                    except (OSError, EOFError, CommError) as exc:
                        self._peer_failed(p, exc)
                self._expire()
            self._run_finished()

    def _next_deadline(self):
        pending = [r.deadline for r in self._posted] + [q[0].deadline for q in self._sends.values() if q]
        return (min(pending) - time.monotonic()) if pending else None

    def _expire(self) -> None:
        now = time.monotonic()
        for req in [r for r in self._posted if r.deadline <= now]:
            self._posted.remove(req)
            self._finish(req, CommTimeoutError(f"rank {self.rank}: {req.describe()} timed out",
                                        op="recv", seq=req.tag, rank=self.rank, peer=req.peer))
        for p, q in self._sends.items():
            if q and q[0].deadline <= now:
                req = q.popleft()
                self._finish(req, CommTimeoutError(
                    f"rank {self.rank}: {req.describe()} timed out ({req.off} of "
                    f"{len(req.header) + len(req.buf)} bytes accepted)", op="send", seq=req.tag,
                    rank=self.rank, peer=p))
                # A half-sent frame leaves the stream unusable for this peer.
                if req.off:
                    self._peer_failed(p, EOFError("send timed out mid-frame"))

    def _progress_send(self, p: int) -> None:
        q, sock = self._sends[p], self.conns[p].sock
        while q:
            try:
                if not write(sock, q[0]):
                    return
            except BlockingIOError:
                return
            self._finish(q.popleft())

    def _progress_recv(self, p: int) -> None:
        conn = self.conns[p]
        while True:
            inc = self._reading.get(p)
            if inc is None:
                what = self._what[p]
                nxt = next_frame(conn, self.rank, p, what)
                if nxt is not None:
                    if nxt.header.kind == DATA:
                        conn.rpos = nxt.start
                        self._reading[p] = self._match(p, nxt.header)
                        continue
                    # A control frame (the peer stopped, and says why): raise its reason.
                    reason = control_reason(conn.rbuf, nxt, conn.rend, False)
                    if reason is not None:
                        if nxt.header.kind == BYE:
                            self._left.add(p)
                        raise control_error(nxt.header, reason, self.rank, p, what)
                if conn.fill() == 0:
                    return
                continue
            take = min(conn.rend - conn.rpos, len(inc.dest) - inc.off)
            if take:
                inc.dest[inc.off:inc.off + take] = conn.rbuf[conn.rpos:conn.rpos + take]
                conn.rpos += take
                inc.off += take
            elif inc.off < len(inc.dest):
                try:
                    n = conn.sock.recv_into(inc.dest[inc.off:])
                except BlockingIOError:
                    return
                if n == 0:
                    raise EOFError
                inc.off += n
            if inc.off < len(inc.dest):
                continue
            del self._reading[p]
            if inc.req is not None:
                inc.req.source = p
                self._finish(inc.req)
            elif not inc.discard:
                # A receive may have been posted while this frame was being read into a
                # buffer of its own: it takes the frame now instead of waiting forever.
                req = next((r for r in self._posted if r.peer in (ANY, p) and r.tag == inc.hdr.sig.seq), None)
                if req is not None:
                    self._posted.remove(req)
                    self._complete_recv(req, p, inc.hdr, inc.dest)
                else:
                    self._unexpected.append((next(self._order), p, inc.hdr, inc.dest))

    def _match(self, p: int, hdr: Header) -> "Incoming":
        """Route an arriving frame: into a matching posted receive, or keep it as unexpected."""
        if hdr.kind != DATA or hdr.sig.op != "p2p":
            raise ProtocolError(f"rank {self.rank}: non-p2p frame on the p2p channel from rank {p}",
                                rank=self.rank, peer=p)
        for req in self._posted:
            if req.peer in (ANY, p) and req.tag == hdr.sig.seq:
                self._posted.remove(req)
                if hdr.nbytes == len(req.buf) and hdr.sig.dtype == req.sig.dtype:
                    return Incoming(req, hdr, req.buf)
                # Drain the payload, then fail only this request: the stream stays usable.
                self._finish(req, size_error(self.rank, req, p, hdr))
                if hdr.nbytes > self.max_unexpected:
                    raise too_big(self.rank, p, hdr, self._unexpected_bytes, self.max_unexpected)
                return Incoming(None, hdr, Discard(hdr.nbytes), discard=True)
        if hdr.nbytes > self.max_unexpected - self._unexpected_bytes:
            raise too_big(self.rank, p, hdr, self._unexpected_bytes, self.max_unexpected)
        self._unexpected_bytes += hdr.nbytes
        return Incoming(None, hdr, memoryview(bytearray(hdr.nbytes)))

    def _complete_recv(self, req: Request, src: int, hdr: Header, data: memoryview) -> None:
        if hdr.nbytes != len(req.buf) or hdr.sig.dtype != req.sig.dtype:
            self._finish(req, size_error(self.rank, req, src, hdr))
            return
        req.buf[:] = data
        req.source = src
        self._finish(req)

    def _dead_error(self, req: Request, peer: int) -> PeerClosedError:
        return PeerClosedError(f"rank {self.rank}: {req.describe()} failed: rank {peer} "
                               f"{self._dead[peer]}", op=req.kind, seq=req.tag, rank=self.rank, peer=peer)

    def _peer_failed(self, p: int, exc: BaseException) -> None:
        self._dead[p] = "closed the connection (died or aborted)" if isinstance(exc, (EOFError, ConnectionError)) \
            else f"failed: {exc}"
        if isinstance(exc, ProtocolError) and exc.origin < 0:
            self._tell_peer(p, exc)
        self._reading.pop(p, None)
        for req in list(self._sends[p]):
            self._finish(req, self._dead_error(req, p))
        self._sends[p].clear()
        for req in [r for r in self._posted if r.peer == p]:
            self._posted.remove(req)
            self._finish(req, self._dead_error(req, p))

    def _tell_peer(self, p: int, exc: BaseException) -> None:
        """This rank stops reading from ``p`` because of what ``p`` sent: say why in an ABORT
        frame and end the stream, so that ``p`` fails at once instead of at its deadline."""
        conn, q = self.conns[p], self._sends[p]
        try:
            if not (q and q[0].off):   # never inside a half-written frame of our own
                conn.sock.send(control_frame(ABORT, str(exc), self.rank, type(exc).__name__))
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            for q in self._sends.values():
                for req in q:
                    self._finish(req, exc)
                q.clear()
            for req in self._posted:
                self._finish(req, exc)
            self._posted.clear()
        self._run_finished()
