"""TCP transport, per connection: one peer's socket with its read-ahead buffer, and the
per-peer progress of a step's sends and receives.

Used by ``tcp.transport`` (the data path), ``tcp.failure`` (ABORT/BYE, error texts)
and ``p2p`` (which reads frames from ``Conn`` the same way). Nothing here blocks: reads
return 0 when the socket would block, and end of stream raises ``EOFError``.
"""

from __future__ import annotations

import socket
from collections import deque

from pycoll.transport.base import InFrame

READ_AHEAD = 64 << 10
IOV_BATCH = 64


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


class RecvState:
    """The frames a step still expects from one peer, and how far the current one got."""

    __slots__ = ("frames", "cur", "off", "total", "done")

    def __init__(self) -> None:
        self.frames: deque[InFrame] = deque()
        self.cur: InFrame | None = None  # frame whose header is parsed, payload in progress
        self.off = 0
        self.total = 0                   # payload bytes expected from this peer in this step
        self.done = 0                    # ... of which complete frames account for this many


class SendState:
    """The buffers (headers and payloads) a step sends to one peer, and how far it got."""

    __slots__ = ("bufs", "hdr", "i", "off", "sending")

    def __init__(self) -> None:
        self.bufs: list = []
        self.hdr: list[bool] = []        # bufs[j] is a frame header
        self.i = self.off = 0
        # Set from a send until its bytes are counted: still set after an exception means
        # one came between the two (KeyboardInterrupt), and where the stream stands is unknown.
        self.sending = False

    def partial(self) -> int:
        """Bytes left of a frame that is half sent (0 at a frame boundary; -1: unknown)."""
        if self.sending:
            return -1
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
