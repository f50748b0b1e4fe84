"""In-process transport: ranks are threads of one process, frames go through queues.

For unit tests of schedules and the executor without sockets. Frames are copied into the
queue (the sender may overwrite its buffer after the step), headers are encoded and
decoded exactly as on the wire so the same checks run. Receives from different peers
progress independently (as on TCP), frames of one pair in order.

Two modes (trio's memory streams and their lockstep variant are the model):

- buffered (the default): queues are unbounded, a send completes at once. It cannot expose a
  deadlock that needs full buffers.
- ``lockstep=True``: a send completes only once the peer's receive has taken the frame, that
  is, once the peer posts the matching receive in an exchange of its own. A schedule that only
  works because the medium buffers (both peers send in one step and receive in the next)
  deadlocks here, the way it would on TCP once a message outgrows the socket buffers.

In both modes a deadlock is reported instead of waited out: when every rank that is still
open sits in an exchange that cannot progress, each of them raises ``DeadlockError`` naming
what every rank waits for. (A rank outside an exchange may yet post what the others need,
so a wait with such a rank ends at its deadline, as on a real medium.)

The verbs behave as the conformance kit (pycoll/testing/conformance.py) asks of every transport:
``abort(reason)`` fails every current and later exchange of the world with the reason and
the aborting rank; ``sever`` is a crash as peers see it (no reason); after ``close`` this
rank's exchanges fail, and peers waiting for its frames get ``PeerClosedError``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Sequence

from pycoll.errors import CommError, CommTimeoutError, PeerClosedError
from pycoll.transport.base import InFrame, OutFrame, Transport, check_header
from pycoll.wire import decode_header, header_length


class DeadlockError(CommTimeoutError):
    """Every open rank waits for another: the timeout that would follow, reported early."""


class MemoryHub:
    """The shared medium of one in-process world: one FIFO per ordered pair of ranks."""

    def __init__(self, world: int, lockstep: bool = False) -> None:
        self.world, self.lockstep = world, lockstep
        self.cv = threading.Condition()
        self.queues = {(s, d): deque() for s in range(world) for d in range(world)}
        self.taken = dict.fromkeys(self.queues, 0)    # frames received, per ordered pair
        self.posted = dict.fromkeys(self.queues, 0)   # frames sent, per ordered pair
        self.aborted: str | None = None               # the first abort's reason
        self.aborter = -1
        self.gone: dict[int, str] = {}                # rank -> "closed" or "severed"
        self.deadlock: str | None = None              # what every rank waited for, once stuck
        self.deadlock_peer: dict[int, int] = {}       # rank -> the first peer it waited for
        self.version = 0                              # bumped on every change of the medium
        self.blocked: dict[int, tuple[int, str, int]] = {}  # rank -> (version seen, waits, peer)

    def transports(self) -> list["MemoryTransport"]:
        return [MemoryTransport(self, r) for r in range(self.world)]

    def changed(self) -> None:
        """Call with ``cv`` held after any change a blocked rank may be waiting for."""
        self.version += 1
        self.cv.notify_all()

    def stuck(self) -> bool:
        """Whether every open rank is blocked on the medium as it is now (``cv`` held)."""
        open_ranks = [r for r in range(self.world) if r not in self.gone]
        return bool(open_ranks) and all(
            r in self.blocked and self.blocked[r][0] == self.version for r in open_ranks)


class MemoryTransport(Transport):
    name = "memory"

    def __init__(self, hub: MemoryHub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.failure: CommError | None = None   # after a failed exchange nothing more goes

    @property
    def lockstep(self) -> bool:
        return self.hub.lockstep

    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        try:
            self._exchange(outs, ins, deadline, what)
        except CommError as exc:
            # Frames of the failed step may be left half-taken: as on TCP (and as Gloo's
            # context), the transport is unusable after an error.
            if self.failure is None:
                self.failure = exc
            raise

    def _exchange(self, outs, ins, deadline, what) -> None:
        hub, me = self.hub, self.rank
        recvs: dict[int, deque[InFrame]] = {}
        for f in ins:
            recvs.setdefault(f.peer, deque()).append(f)
        until: dict[int, int] = {}   # lockstep: peer -> frames of ours it must have taken
        with hub.cv:
            self._check_own(what)
            for f in outs:
                key = (me, f.peer)
                hub.queues[key].append((bytes(f.header), bytes(f.payload)))
                hub.posted[key] += 1
                until[f.peer] = hub.posted[key]
            if outs:
                hub.changed()
            if not hub.lockstep:
                until.clear()
        while recvs or until:
            got = self._next(recvs, until, deadline, what)
            if got is None:
                continue
            f, header, payload = got
            # Checked, copied and reduced outside the lock, so ranks' reductions overlap.
            check_header(f.expect, decode_header(memoryview(header)[4:4 + header_length(header[:4])]),
                         me, f.peer)
            f.dest[:] = payload
            if f.on_done is not None:
                f.on_done()

    def _next(self, recvs, until, deadline, what):
        """The next frame this rank can take, or None once lockstep sends have completed;
        blocks (under the deadline, watching for aborts, departures and deadlock) until one."""
        hub, me = self.hub, self.rank
        with hub.cv:
            while True:
                self._check_own(what)
                for peer in list(recvs):
                    q = hub.queues[(peer, me)]
                    if q:
                        f = recvs[peer].popleft()
                        if not recvs[peer]:
                            del recvs[peer]
                        header, payload = q.popleft()
                        hub.taken[(peer, me)] += 1
                        hub.changed()
                        return f, header, payload
                for peer in [p for p, n in until.items() if hub.taken[(me, p)] >= n]:
                    del until[peer]
                if not recvs and not until:
                    return None
                self._check_world(what)
                waits = sorted(set(recvs) | set(until))
                for peer in waits:
                    if peer in hub.gone:
                        raise self._gone_error(peer, what)
                left = deadline - time.monotonic()
                if left <= 0:
                    peer = waits[0]
                    raise CommTimeoutError(f"{what}: rank {me} timed out waiting for rank {peer} "
                                           f"({self._describe(recvs, until)})", rank=me, peer=peer)
                hub.blocked[me] = (hub.version, f"rank {me} ({what}) {self._describe(recvs, until)}",
                                   waits[0])
                if hub.stuck():
                    hub.deadlock = "; ".join(hub.blocked[r][1] for r in sorted(hub.blocked))
                    hub.deadlock_peer = {r: b[2] for r, b in hub.blocked.items()}
                    hub.cv.notify_all()
                else:
                    hub.cv.wait(left)
                hub.blocked.pop(me, None)

    def _describe(self, recvs, until) -> str:
        parts = [f"waits for {len(fs)} frame(s) from rank {p}" for p, fs in sorted(recvs.items())]
        parts += [f"waits for rank {p} to receive {n - self.hub.taken[(self.rank, p)]} frame(s)"
                  f" (lockstep)" for p, n in sorted(until.items())]
        return ", ".join(parts)

    def _check_own(self, what: str) -> None:
        """Raise if this rank can no longer exchange: closed, severed, aborted, deadlocked."""
        hub, me = self.hub, self.rank
        if me in hub.gone:
            raise CommError(f"{what}: rank {me}'s memory transport is {hub.gone[me]}", rank=me)
        if self.failure is not None and hub.deadlock is None and hub.aborted is None:
            raise PeerClosedError(f"{what}: rank {me}'s memory transport failed earlier: {self.failure}",
                                  rank=me, peer=self.failure.peer)
        if hub.deadlock is not None:
            raise DeadlockError(f"{what}: deadlock: every open rank waits for another: {hub.deadlock}",
                                rank=me, peer=hub.deadlock_peer.get(me, -1))
        if hub.aborted is not None and hub.aborter == me:
            raise PeerClosedError(f"{what}: rank {me}: transport was aborted ({hub.aborted})", rank=me)

    def _check_world(self, what: str) -> None:
        """Before blocking: raise if some rank aborted (frames that did arrive are taken first,
        as a TCP reader meets a peer's ABORT frame only behind the data sent before it)."""
        hub, me = self.hub, self.rank
        if hub.aborted is not None:
            exc = PeerClosedError(f"{what}: rank {me} stopped because rank {hub.aborter} aborted: "
                                  f"{hub.aborted}", rank=me, peer=hub.aborter)
            exc.origin, exc.root_cause = hub.aborter, hub.aborted
            raise exc

    def _gone_error(self, peer: int, what: str) -> PeerClosedError:
        if self.hub.gone[peer] == "closed":
            text = (f"rank {peer} has destroyed its process group (shutdown) while rank {self.rank} "
                    f"still expected data from it")
        else:
            text = f"rank {peer} died (its transport was severed) while rank {self.rank} waited for it"
        exc = PeerClosedError(f"{what}: {text}", rank=self.rank, peer=peer)
        exc.origin = peer
        return exc

    def abort(self, reason: str) -> None:
        with self.hub.cv:
            if self.hub.aborted is None:   # the first reason is the one every rank reports
                self.hub.aborted, self.hub.aborter = reason, self.rank
            self.hub.changed()

    def sever(self, reason: str) -> None:
        """A crash, as peers see it: they learn that this rank is gone, not why."""
        with self.hub.cv:
            self.hub.gone.setdefault(self.rank, "severed")
            self.hub.changed()

    def close(self) -> None:
        with self.hub.cv:
            self.hub.gone.setdefault(self.rank, "closed")
            self.hub.changed()
