"""Point-to-point engine: send/recv with tags and any-source receive, one matching for all peers.

Ranks of this host are reached through shared memory (``p2p_local``: a ring per ordered
pair, never a socket), ranks of other hosts over dedicated sockets (``p2p_stream``; apart
from the collective sockets, so an unmatched large ``isend`` never blocks a collective).
One set of posted receives and unexpected messages serves both: a message that matches a
posted receive (same source or any source, same tag, in posting order) is read straight
into that receive's tensor; one that matches nothing yet is kept as an unexpected message
until a receive claims it (MPI's eager protocol). Sends to a peer go out in posting order:
one with nothing queued before it is written by the caller's thread as far as the socket
or ring takes it, the rest by the progress thread (or, for a local peer, by a thread
waiting on it). So ``isend``/``irecv`` pairs in any order, rings of blocking sends and
batch_isend_irecv all complete without deadlock.

One progress thread per group sleeps in ``poll`` on the sockets and a wake pipe, which is
also the bell a local peer rings when it wrote and nobody of this rank polls its rings.

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
from pycoll.transport.tcp import p2p_local, p2p_stream
from pycoll.transport.tcp.p2p_requests import ANY, Discard, Incoming, Message, Request, size_error, too_big, write
from pycoll.transport.tcp.conn import Conn
from pycoll.wire import (
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
                 runner: callbacks.Runner | None = None, links=None) -> None:
        """``links(wake_fd)``, where given, makes this rank's shared-memory links to the
        ranks of its host (``pycoll.shm.links.Links``), whose bell is the engine's wake pipe."""
        self.rank, self.world = rank, world
        self._own_runner = runner is None
        runner = runner or callbacks.Runner(f"pycoll-callbacks-{rank}")
        self._runner = runner
        self.conns = {p: Conn(s, p) for p, s in socks.items()}
        self._lock = threading.Lock()
        self._sends: dict[int, deque[Request]] = {p: deque() for p in socks}
        self._posted: list[Request] = []
        self._unexpected: deque[tuple[int, int, Message, memoryview]] = deque()  # (order, peer, msg, data)
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
        # The ranks of this host, reached through shared memory (``pycoll.shm.links``): their
        # sockets carry no bytes, but stay open and watched, so a peer's death is an EOF.
        self.local = None
        if links is not None:
            try:
                self.local = p2p_local.Local(self, links(self._wake_w))
            except BaseException:
                os.close(self._wake_r)
                os.close(self._wake_w)
                raise
        self._thread: threading.Thread | None = None
        self.sleep_until = 0.0   # when the progress thread's poll ends at the latest
        if self.conns:
            self._thread = callbacks.start_thread(self._loop, self._thread_failed, f"pycoll-p2p-{rank}", runner)

    # -- API ---------------------------------------------------------------------------
    def isend(self, peer: int, tag: int, buf: memoryview, dtype: str, numel: int, deadline: float,
              on_done=None) -> Request:
        req = Request("send", peer, tag, Signature("p2p", tag, dtype, numel), buf, deadline, on_done)
        if self.local is not None and peer in self.local.peers:
            return self.local.isend(req)
        req.header = Header(DATA, req.sig, 0, 0, len(buf)).encode()
        queued = False
        with self._lock:
            if not self._refuse(req):
                if not self._sends[peer] and self._send_now(req):
                    self._finish(req)
                else:
                    self._sends[peer].append(req)
                    queued = True
        if queued:
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
                    _, src, msg, data = item
                    if (peer in (ANY, src)) and msg.tag == tag:
                        self._unexpected.remove(item)
                        self._unexpected_bytes -= len(data)
                        self._complete_recv(req, src, msg, data)
                        break
                else:
                    if peer != ANY and peer in self._dead:
                        self._finish(req, self._dead_error(req, peer))
                    else:
                        self._posted.append(req)
                        posted = True
                        if self.local is not None:   # what a local peer already wrote
                            posted = not self.local.receive_for(req)
        if posted and (peer == ANY or peer in self.conns and (self.local is None or peer not in self.local.peers)):
            self._wake()
        else:
            self._run_finished()
            if posted:
                self.mind(req)
        return req

    def wait(self, req: Request, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``req``; whether it is done (pycoll's own
        exchanges on the engine: monitored barrier, clocks, stragglers)."""
        end = time.monotonic() + max(0.0, timeout)
        if self.local is not None and not req.done.is_set():
            self.local.drive(req, end)
        return req.done.wait(max(0.0, end - time.monotonic()))

    def mind(self, req: Request) -> None:
        """Wake the progress thread if ``req``'s deadline comes before its sleep ends (a
        request it need not serve otherwise: a local peer's, progressed where it is waited for)."""
        if req.deadline < self.sleep_until:
            self._wake()

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

    def close(self, reason: str = "process group destroyed") -> None:
        """Fail what is pending with ``reason``, say goodbye, release everything."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        half_sent = {p for p, q in self._sends.items() if q and q[0].off}   # no BYE inside a frame
        self._fail_all(PeerClosedError(f"rank {self.rank}: {reason}", rank=self.rank))
        if self.local is not None:
            self.local.close()   # says goodbye to the local peers before their sockets end
        for p, c in self.conns.items():
            # A goodbye: a peer still watching this connection (a shrink) knows it left, not died.
            if p not in self._dead and p not in half_sent and (self.local is None or p not in self.local.peers):
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
        if req.watched:
            self.local.unobserve(req)
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
                        out = self._sends[p] and (self.local is None or p not in self.local.peers)
                        poller.register(c.fd, select.POLLIN | (select.POLLOUT if out else 0))
                timeout = self._next_deadline()
                # Bounded slices: a deadline days away must not overflow poll's int milliseconds.
                timeout = MAX_POLL_S if timeout is None else max(0.0, min(timeout, MAX_POLL_S))
                self.sleep_until = time.monotonic() + timeout
            poller.poll(timeout * 1000)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            with self._lock:
                for p in list(self.conns):
                    if p in self._dead:
                        continue
                    try:
                        if self.local is not None and p in self.local.peers:
                            self.local.progress(p)
                            self.local.watch(p)
                            continue
                        try:
                            p2p_stream.progress_send(self, p)
                        except OSError:
                            p2p_stream.progress_recv(self, p)   # the peer may have said why it stopped
                            raise
                        p2p_stream.progress_recv(self, p)
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

    def _arrived(self, p: int, inc: Incoming) -> None:
        """A message from ``p`` is in (call holding the lock): finish its receive, or keep it."""
        if inc.req is not None:
            inc.req.source = p
            self._finish(inc.req)
        elif not inc.discard:
            # A receive may have been posted while this frame was being read into a
            # buffer of its own: it takes the frame now instead of waiting forever.
            req = next((r for r in self._posted if r.peer in (ANY, p) and r.tag == inc.hdr.tag), None)
            if req is not None:
                self._posted.remove(req)
                self._complete_recv(req, p, inc.hdr, inc.dest)
            else:
                self._unexpected.append((next(self._order), p, inc.hdr, inc.dest))

    def _match(self, p: int, msg: Message) -> "Incoming":
        """Route an arriving message: into a matching posted receive, or keep it as unexpected."""
        for req in self._posted:
            if req.peer in (ANY, p) and req.tag == msg.tag:
                self._posted.remove(req)
                if msg.nbytes == len(req.buf) and msg.dtype == req.sig.dtype:
                    return Incoming(req, msg, req.buf)
                # Drain the payload, then fail only this request: the stream stays usable.
                self._finish(req, size_error(self.rank, req, p, msg))
                if msg.nbytes > self.max_unexpected:
                    raise too_big(self.rank, p, msg, self._unexpected_bytes, self.max_unexpected)
                return Incoming(None, msg, Discard(msg.nbytes), discard=True)
        if msg.nbytes > self.max_unexpected - self._unexpected_bytes:
            raise too_big(self.rank, p, msg, self._unexpected_bytes, self.max_unexpected)
        self._unexpected_bytes += msg.nbytes
        return Incoming(None, msg, memoryview(bytearray(msg.nbytes)))

    def _complete_recv(self, req: Request, src: int, msg: Message, data: memoryview) -> None:
        if msg.nbytes != len(req.buf) or msg.dtype != req.sig.dtype:
            self._finish(req, size_error(self.rank, req, src, msg))
            return
        req.buf[:] = data
        req.source = src
        self._finish(req)

    def _dead_error(self, req: Request, peer: int) -> PeerClosedError:
        return PeerClosedError(f"rank {self.rank}: {req.describe()} failed: rank {peer} "
                               f"{self._dead[peer]}", op=req.kind, seq=req.tag, rank=self.rank, peer=peer)

    def _peer_failed(self, p: int, exc: BaseException) -> None:
        if isinstance(exc, (EOFError, ConnectionError)):
            self._dead[p] = ("destroyed its process group (it left)" if p in self._left
                             else "closed the connection (died or aborted)")
        else:
            self._dead[p] = f"failed: {exc}"
        if self.local is not None and p in self.local.peers:
            self.local.failed(p, exc)
        elif isinstance(exc, ProtocolError) and exc.origin < 0:
            p2p_stream.tell_peer(self, p, exc)
        inc = self._reading.pop(p, None)
        if inc is not None and inc.req is not None:   # a message from p that stopped halfway
            self._finish(inc.req, self._dead_error(inc.req, p))
        elif inc is not None and not inc.discard:
            self._unexpected_bytes -= len(inc.dest)
        for req in list(self._sends[p]):
            self._finish(req, self._dead_error(req, p))
        self._sends[p].clear()
        for req in [r for r in self._posted if r.peer == p]:
            self._posted.remove(req)
            self._finish(req, self._dead_error(req, p))

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
