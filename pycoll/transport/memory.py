"""In-process transport: ranks are threads of one process, frames go through queues.

For unit tests of schedules and the executor without sockets. Frames are copied into the
queue (the sender may overwrite its buffer after the step), headers are encoded and
decoded exactly as on the wire so the same checks run. Queues are unbounded, so it cannot
expose a deadlock that needs a full socket buffer; the TCP conformance tests do that.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Sequence

from pycoll.errors import CommTimeoutError, PeerClosedError
from pycoll.transport.base import InFrame, OutFrame, Transport, check_header
from pycoll.wire import decode_header, header_length


class MemoryHub:
    """The shared medium of one in-process world: one FIFO per ordered pair of ranks."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cv = threading.Condition()
        self.queues = {(s, d): deque() for s in range(world) for d in range(world)}
        self.aborted: str | None = None

    def transports(self) -> list["MemoryTransport"]:
        return [MemoryTransport(self, r) for r in range(self.world)]


class MemoryTransport(Transport):
    name = "memory"

    def __init__(self, hub: MemoryHub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world

    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        hub = self.hub
        with hub.cv:
            for f in outs:
                hub.queues[(self.rank, f.peer)].append((f.header, bytes(f.payload)))
            hub.cv.notify_all()
        for f in ins:
            q = hub.queues[(f.peer, self.rank)]
            with hub.cv:
                while not q:
                    if hub.aborted is not None:
                        raise PeerClosedError(f"{what}: world aborted ({hub.aborted})",
                                              rank=self.rank, peer=f.peer)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommTimeoutError(
                            f"{what}: rank {self.rank} timed out waiting for rank {f.peer}",
                            rank=self.rank, peer=f.peer)
                    hub.cv.wait(left)
                header, payload = q.popleft()
            got = decode_header(memoryview(header)[4:4 + header_length(header[:4])])
            check_header(f.expect, got, self.rank, f.peer)
            f.dest[:] = payload
            if f.on_done is not None:
                f.on_done()

    def abort(self, reason: str) -> None:
        with self.hub.cv:
            self.hub.aborted = reason
            self.hub.cv.notify_all()

    def close(self) -> None:
        pass
