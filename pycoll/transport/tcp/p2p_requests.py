"""What the point-to-point engine tracks: posted requests, and the frame it is reading.

``Request``: a posted send or receive. ``Incoming``: a frame being read, into a posted
receive's buffer, a fresh buffer (an unexpected message) or ``Discard`` (a payload drained
because it does not fit the receive that matched it, read through a small fixed buffer and
never allocated whole). ``write``: as much of a send's frame as a non-blocking socket takes.
``too_big`` and ``size_error``: the errors of messages that do not fit.
"""

from __future__ import annotations

import socket
import threading

from pycoll.errors import ProtocolError

ANY = -1           # the peer of a receive from any source
SINK = 64 << 10


class Message:
    """What a message's header says: tag, dtype, element count, bytes (from a wire header,
    or from a shared-memory link's header: ``pycoll.shm.links``)."""

    __slots__ = ("tag", "dtype", "numel", "nbytes")

    def __init__(self, tag: int, dtype: str, numel: int, nbytes: int) -> None:
        self.tag, self.dtype, self.numel, self.nbytes = tag, dtype, numel, nbytes


class Done:
    """``threading.Event``'s is_set/set/wait for a request, at a tenth of its making cost
    (an Event makes a Condition; this, one lock held until ``set``): one is made per send
    and receive, on the latency path."""

    __slots__ = ("_flag", "_gate")

    def __init__(self) -> None:
        self._flag = False
        self._gate = threading.Lock()
        self._gate.acquire()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            self._gate.release()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._flag:
            if self._gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                self._gate.release()   # the next waiter passes too
        return self._flag


class Request:
    """One posted send or receive. The engine finishes it under its lock (``done``,
    ``error``, ``source``) and calls ``on_done(request)`` once afterwards, holding no lock."""

    __slots__ = ("kind", "peer", "tag", "sig", "buf", "deadline", "done", "error", "source",
                 "on_done", "off", "header", "pos", "watched")

    def __init__(self, kind, peer, tag, sig, buf, deadline, on_done=None):
        self.kind, self.peer, self.tag, self.sig, self.buf = kind, peer, tag, sig, buf
        self.deadline = deadline
        self.done = Done()
        self.error: BaseException | None = None
        self.source = peer
        self.on_done = on_done
        self.off = 0
        self.watched = False   # someone waits for it without polling (p2p_local.Local.watch)

    def describe(self) -> str:
        who = "any rank" if self.peer == ANY else f"rank {self.peer}"
        verb = "send to" if self.kind == "send" else "recv from"
        return f"{verb} {who} (tag {self.tag}, {self.sig.dtype}[{self.sig.numel}], {len(self.buf)} bytes)"


def write(sock: socket.socket, req: Request) -> bool:
    """Send what the (non-blocking) socket takes of ``req``'s frame from ``req.off`` on;
    True once all of it has gone."""
    hl = len(req.header)
    iov = [req.header[req.off:], req.buf] if req.off < hl else [req.buf[req.off - hl:]]
    req.off += sock.sendmsg(iov)
    return req.off == hl + len(req.buf)


class Incoming:
    """A frame being read: into a posted request's buffer, or into a fresh unexpected buffer."""

    __slots__ = ("req", "hdr", "dest", "off", "discard")

    def __init__(self, req, hdr, dest, discard=False):
        self.req, self.hdr, self.dest, self.off, self.discard = req, hdr, dest, 0, discard


class Discard:
    """Stands in for a destination buffer when a payload is read only to be dropped."""

    __slots__ = ("n", "sink")

    def __init__(self, n: int) -> None:
        self.n, self.sink = n, memoryview(bytearray(min(n, SINK)))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl: slice) -> memoryview:
        start = sl.start or 0
        stop = self.n if sl.stop is None else sl.stop
        return self.sink[:min(stop - start, len(self.sink))]

    def __setitem__(self, sl: slice, data) -> None:
        pass


def too_big(rank: int, peer: int, msg: Message, held: int, bound: int) -> ProtocolError:
    """The error of an unexpected message past ``PYCOLL_MAX_UNEXPECTED_BYTES``."""
    return ProtocolError(
        f"rank {rank}: rank {peer} sent an unexpected message of {msg.nbytes} bytes (tag "
        f"{msg.tag}) while {held} bytes of unexpected messages are held; the bound is "
        f"PYCOLL_MAX_UNEXPECTED_BYTES={bound}: post the receive first or raise the bound",
        op="recv", seq=msg.tag, rank=rank, peer=peer)


def size_error(rank: int, req: Request, src: int, msg: Message) -> ProtocolError:
    """A message whose dtype or size differs from the posted receive's."""
    return ProtocolError(f"rank {rank}: {req.describe()} but rank {src} sent "
                         f"{msg.dtype}[{msg.numel}] with that tag",
                         op="recv", seq=req.tag, rank=rank, peer=src)
