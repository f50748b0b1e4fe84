"""Point-to-point with the ranks of this host: the engine's messages through shared memory.

``P2PEngine`` (``p2p.py``) matches every message, from a socket or from a ring, with one set
of posted receives and unexpected messages, so tags, any-source receives and c10d's order
(per pair and tag, in posting order) hold across both. ``Local`` moves the bytes of the
engine's local peers through ``pycoll.shm.links``: a send copies into the ring to its peer
in the caller's thread as far as the ring has room (a message that fits is done at once);
a receive copies from the ring straight into the posted tensor. What is left (a message
larger than the ring, a receive posted before its message) progresses where someone waits:

- a blocking wait (``Work.wait``) polls the rings in its own thread (``drive``) while
  polling pays (``transport.spin``: never while another task waits for a core), and the
  peer, seeing it poll, makes no system call to wake it;
- otherwise the engine's thread, woken by the peer's byte on its wake pipe.

Each local peer's socket carries no bytes but stays open and watched: a peer that dies
(``kill -9`` included) is an EOF at once, and one that destroyed its group says so in its
page first (``links.CLOSED``), so it is known to have left, not died.
"""

from __future__ import annotations

import socket
import time

from pycoll.errors import CommError, ProtocolError
from pycoll.transport import spin
from pycoll.transport.tcp.p2p_requests import ANY, Request

# The longest a blocking wait polls its rings before it leaves them to the engine's thread:
# as the arena's barriers (pycoll/shm/arena.py), it must outlast a wake-up of the peer.
SPIN_SECONDS = 0.002
# A sleeping wait looks at its deadline this often (the doorbell wakes it for everything else).
SLEEP_SLICE = 0.05


class Local:
    """The engine's shared-memory side (its lock guards everything here); ``links`` is a
    ``pycoll.shm.links.Links``."""

    def __init__(self, engine, links) -> None:
        self.e, self.links = engine, links
        self.peers = set(links.peers())
        self._tasks = spin.RunnableTasks()
        self._policy = spin.SpinPolicy(SPIN_SECONDS, self._tasks)
        self.closed = False

    # -- posting -----------------------------------------------------------------------
    def isend(self, req: Request) -> Request:
        e = self.e
        req.header = self.links.header(req.tag, req.sig.dtype, req.sig.numel, len(req.buf))
        with e._lock:
            if not e._refuse(req):
                q = e._sends[req.peer]
                if not q and self.links.write(req.peer, req):
                    e._finish(req)
                else:
                    q.append(req)
                    self._push(req.peer)
        e._run_finished()
        if not req.done.is_set():
            e.mind(req)
        return req

    def receive_for(self, req: Request) -> bool:
        """Take what local peers already wrote for the just-posted ``req`` (call holding the
        lock); whether it finished."""
        for p in self._sources(req):
            self._step(p, False)
            if req.done.is_set():
                break
        return req.done.is_set()

    def _sources(self, req: Request):
        if req.peer == ANY:
            return [p for p in self.peers if p not in self.e._dead]
        return [req.peer] if req.peer in self.peers and req.peer not in self.e._dead else []

    def drives(self, req: Request) -> bool:
        """Whether a wait on ``req`` should poll the rings itself: a message that is all in
        rings nobody (``links.notify``), so its receive progresses in the calls of its rank."""
        return bool(self._sources(req))

    def poke(self, req: Request) -> None:
        """One look at the rings for ``req`` (``Work.is_completed`` of a request nobody waits on)."""
        with self.e._lock:
            self._step_all()
        self.e._run_finished()

    def observe(self, req: Request) -> None:
        """Someone waits for ``req`` without polling (its future): from now until it is
        done, a message to this rank rings its engine (``links.WATCHING``)."""
        with self.e._lock:
            if req.done.is_set() or req.watched:
                return
            req.watched = True
            self.links.watching(+1)
            self._step_all()   # what came while nobody watched
        self.e._run_finished()

    def unobserve(self, req: Request) -> None:
        """``req`` is done (call holding the lock)."""
        req.watched = False
        if not self.closed:
            self.links.watching(-1)

    # -- progress (call holding the lock) ---------------------------------------------------
    def progress(self, p: int) -> None:
        self._push(p)
        self._pull(p)

    def _step(self, p: int, send: bool = True) -> None:
        """``progress`` in a caller's thread: what breaks the pair fails it, not the caller."""
        if self.closed:
            return
        try:
            self._check(p)
            if send:
                self._push(p)
            self._pull(p)
        except (OSError, EOFError, CommError) as exc:
            self.e._peer_failed(p, exc)

    def _step_all(self) -> None:
        for p in self.peers:
            if p not in self.e._dead:
                self._step(p)

    def _push(self, p: int) -> None:
        """Write what the ring to ``p`` takes of the sends queued for it, in order."""
        e, links = self.e, self.links
        q = e._sends[p]
        while q and links.write(p, q[0]):
            e._finish(q.popleft())
        if q:
            links.blocked(p, True)
            while q and links.write(p, q[0]):   # room the peer made before it saw the flag
                e._finish(q.popleft())
        if not q:
            links.blocked(p, False)

    def _pull(self, p: int) -> None:
        """Read what ``p`` wrote: into matching receives, or kept as unexpected messages."""
        e, links = self.e, self.links
        while True:
            inc = e._reading.get(p)
            if inc is None:
                msg = links.next_message(p, e.rank)
                if msg is None:
                    return
                inc = e._reading[p] = e._match(p, msg)
            want = len(inc.dest) - inc.off
            if want:
                dest = None if inc.discard else inc.dest[inc.off:]
                inc.off += links.read_into(p, dest, want)
                if inc.off < len(inc.dest):
                    return
            del e._reading[p]
            e._arrived(p, inc)

    def watch(self, p: int) -> None:
        """Whether ``p`` is still there: its socket's EOF is its death, or its goodbye when
        its page says it closed (then after the messages it wrote before are read)."""
        self._check(p)
        try:
            data = self.e.conns[p].sock.recv(4096, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        if data:
            return   # nothing is sent on a local peer's socket: not ours to read
        self._pull(p)
        if self.links.closed(p):
            self.e._left.add(p)
        raise EOFError

    def _check(self, p: int) -> None:
        """Raise what ``p`` said when it stopped reading this rank (a malformed message)."""
        why = self.links.broke_with(p)
        if why is not None:
            exc = ProtocolError(f"rank {self.e.rank}: rank {p} stopped reading this rank's point-to-point "
                                f"messages: {why}", rank=self.e.rank, peer=p)
            exc.origin = p
            raise exc

    def failed(self, p: int, exc: BaseException) -> None:
        """``p`` failed (call holding the lock): a malformed message of its own is told to it;
        a thread of this rank asleep on a request to or from ``p`` is woken to see it fail."""
        if isinstance(exc, ProtocolError) and exc.origin < 0:
            self.links.break_with(p, str(exc))
        self.links.wake_self()

    # -- a blocking wait ---------------------------------------------------------------
    def drive(self, req: Request, until: float | None = None) -> None:
        """Wait for ``req`` in this thread: poll the rings while polling pays, then sleep on
        the doorbell, which the peers ring while this thread is there (the engine's thread
        is left out: one wake-up, not two). Every local peer progresses here, not only
        ``req``'s: a send queued to another peer may be what ``req``'s peer waits for. At
        ``req``'s deadline this returns and the engine's thread fails it; at ``until``
        (a wait with a timeout) it returns too."""
        e, links, policy = self.e, self.links, self._policy
        if not self.drives(req):
            return
        end = req.deadline if until is None else min(until, req.deadline)
        with e._lock:
            links.driving(+1)
        sleeping = blocked = False
        try:
            now = time.monotonic()
            spinning = policy.begin(now, end - now)
            while True:
                seen = links.doorbell() if sleeping else 0
                with e._lock:
                    self._step_all()
                e._run_finished()
                if req.done.is_set():
                    break
                now = time.monotonic()
                if now >= end or self.closed:
                    break
                if spinning and policy.poll(now):
                    continue
                spinning, blocked = False, True
                if not sleeping:
                    with e._lock:
                        links.sleeping(+1)
                    sleeping = True
                    continue   # the doorbell read first, then the rings once more
                links.sleep(seen, min(SLEEP_SLICE, end - now))
        finally:
            with e._lock:
                if sleeping:
                    links.sleeping(-1)
                links.driving(-1)
                self._step_all()   # a peer that saw this thread here did not ring the engine
            e._run_finished()
        if blocked:
            policy.unanswered()
        else:
            policy.answered()

    def close(self) -> None:
        with self.e._lock:
            self.closed = True
            self.links.wake_self()
            self.links.close()
        self._tasks.close()
