"""Shared-memory transport, the layout: per-pair mailboxes in an arena's slots, sans waiting.

Each local rank's share of the arena's slots (its two slots, contiguous) starts with a 4 KiB
page of its own, then holds one mailbox per destination rank. A mailbox is a ring of bytes
with one writer and one reader (a TCP connection in memory): the frames of the pair
(``<u32 length> <msgpack header> <payload>``, as on the wire) go through it in order, a
payload larger than the mailbox in pieces as the reader frees room. A rank's page holds

- its counters: bytes sent to each peer (``SENT``), bytes taken from each peer (``TAKEN``).
  Each word has a single writer, and x86 keeps a writer's stores in order, so a reader that
  sees a counter also sees the bytes written before it;
- its state (open, aborted, closed, severed), with an abort's reason, error class and origin;
- its doorbell: the 32-bit word it sleeps on. A rank that changes anything a peer may wait
  for bumps its own byte lane of the peer's doorbell (lane = rank mod 4), then wakes it.

``Mailboxes`` moves bytes and reads and writes those words; it never blocks (the
transport, ``pycoll.testing.mailbox_transport``, waits).
"""

from __future__ import annotations

import ctypes
from collections import deque

from pycoll.errors import ProtocolError
from pycoll.transport.base import InFrame, check_header
from pycoll.transport.frames import garbage
from pycoll.shm import futex
from pycoll.shm.arena import ShmArena
from pycoll.wire import decode_header, header_length

PAGE = 4096                 # a rank's own words, ahead of its mailboxes
MAX_RANKS = 128
SENT, TAKEN = 0, 128        # int64 words of a rank's page: sent[peer], taken[peer]
BELL = 2048                 # byte offset of the doorbell (u32; one byte lane per writer mod 4)
STATE, ORIGIN = 2056 // 8, 2064 // 8
ERROR_AT, REASON_AT = 2072, 2136   # error class name (64 bytes), abort reason (to the page end)
OPEN, ABORTED, CLOSED, SEVERED = 0, 1, 2, 3
MIN_MAILBOX = 1024          # a whole frame header (at most 516 bytes) fits with room to spare


def slot_bytes_for(size: int, mailbox: int) -> int:
    """The arena slot size that gives ``size`` ranks mailboxes of ``mailbox`` bytes."""
    return -(-(PAGE + size * mailbox) // (2 * 4096)) * 4096   # a rank's two slots hold it all


class SendState:
    """The buffers (headers and payloads) a step sends to one peer, and how far it got."""

    __slots__ = ("bufs", "i", "off", "total")

    def __init__(self) -> None:
        self.bufs: list = []
        self.i = self.off = self.total = 0

    def left(self) -> int:
        return sum(len(b) for b in self.bufs[self.i:]) - self.off


class RecvState:
    """The frames a step receives from one peer: the one in progress and those after it."""

    __slots__ = ("frames", "cur", "off", "total", "done")

    def __init__(self) -> None:
        self.frames: deque[InFrame] = deque()
        self.cur: InFrame | None = None
        self.off = self.total = self.done = 0


class Mailboxes:
    """This rank's view of every rank's page and of the mailboxes to and from it."""

    def __init__(self, arena: ShmArena) -> None:
        size, me = arena.size, arena.me
        if size > MAX_RANKS:
            raise ValueError(f"the shared-memory transport serves at most {MAX_RANKS} local ranks")
        region = 2 * arena.slot_bytes
        m = self.size = (region - PAGE) // size // 64 * 64
        if m < MIN_MAILBOX:
            raise ValueError(f"arena slots of {arena.slot_bytes} bytes leave {m}-byte mailboxes for "
                             f"{size} ranks (at least {MIN_MAILBOX}): use ShmTransport.connect")
        self.me, self.ranks = me, list(arena.ranks)
        mv = memoryview(arena.mm)
        self._views = [mv]   # every view of the mapping, released by release()
        base = ctypes.addressof(ctypes.c_char.from_buffer(arena.mm))
        starts = [arena.ctrl_bytes + r * region for r in range(size)]
        self.words = [self._keep(mv[s:s + PAGE].cast("q")) for s in starts]
        self.bytes = [self._keep(mv[s:s + PAGE]) for s in starts]
        self.bell = self._keep(mv[starts[me] + BELL:starts[me] + BELL + 4].cast("I"))
        self.bell_at = [ctypes.c_void_p(base + s + BELL) for s in starts]
        self._out = [self._keep(mv[starts[me] + PAGE + p * m:starts[me] + PAGE + (p + 1) * m])
                     for p in range(size)]
        self._in = [self._keep(mv[s + PAGE + me * m:s + PAGE + (me + 1) * m]) for s in starts]
        self._lane = BELL + me % 4

    def _keep(self, view: memoryview) -> memoryview:
        self._views.append(view)
        return view

    def release(self) -> None:
        """Drop every view of the mapping (the arena can unmap it only then)."""
        for view in reversed(self._views):
            view.release()
        self._views.clear()

    def ring(self, peer: int) -> None:
        """Tell ``peer`` that something it may wait for changed: bump this rank's lane of its
        doorbell, then wake it. The wake is a system call even when the peer is awake:
        skipping it when the peer looks awake could miss a wake-up (x86 may order that load
        before our store, and Python has no fence)."""
        b = self.bytes[peer]
        b[self._lane] = (b[self._lane] + 1) & 0xFF
        futex.wake(self.bell_at[peer])

    def unread(self, peer: int) -> int:
        """Bytes ``peer`` has written to this rank that it has not taken yet."""
        return self.words[peer][SENT + self.me] - self.words[self.me][TAKEN + peer]

    def send_some(self, peer: int, q: SendState) -> bool:
        """Write as much of ``q`` as the mailbox to ``peer`` has room for; whether any moved."""
        ring, m = self._out[peer], self.size
        mine = self.words[self.me]
        sent = start = mine[SENT + peer]
        free = m - (sent - self.words[peer][TAKEN + self.me])
        bufs = q.bufs
        while free > 0 and q.i < len(bufs):
            buf = bufs[q.i]
            pos = sent % m
            n = min(free, len(buf) - q.off, m - pos)
            ring[pos:pos + n] = buf[q.off:q.off + n]
            sent += n
            free -= n
            q.off += n
            if q.off == len(buf):
                q.i, q.off = q.i + 1, 0
        if sent == start:
            return False
        mine[SENT + peer] = sent   # after the bytes: the reader sees them once it sees this
        self.ring(peer)
        return True

    def _peek(self, src: memoryview, at: int, n: int) -> bytes:
        m = self.size
        pos = at % m
        if pos + n <= m:
            return bytes(src[pos:pos + n])
        return bytes(src[pos:]) + bytes(src[:n - (m - pos)])

    def recv_some(self, peer: int, st: RecvState, what: str) -> bool:
        """Take what ``peer`` has written into ``st``'s frames, each header checked before
        any of its payload is written, ``on_done`` run as each completes."""
        src, m, g = self._in[peer], self.size, self.ranks
        mine = self.words[self.me]
        taken = start = mine[TAKEN + peer]
        avail = self.words[peer][SENT + self.me] - taken
        moved = False
        while True:
            if st.cur is None:
                if not st.frames or avail < 4:
                    break
                try:
                    hlen = header_length(self._peek(src, taken, 4))
                    if avail < 4 + hlen:
                        break
                    got = decode_header(self._peek(src, taken + 4, hlen))
                except ProtocolError as exc:
                    raise garbage(g[self.me], g[peer], what, exc) from None
                check_header(st.frames[0].expect, got, g[self.me], g[peer])
                st.cur, st.off = st.frames.popleft(), 0
                taken += 4 + hlen
                avail -= 4 + hlen
            f = st.cur
            dest = f.dest
            while st.off < len(dest) and avail > 0:
                pos = taken % m
                n = min(len(dest) - st.off, avail, m - pos)
                dest[st.off:st.off + n] = src[pos:pos + n]
                st.off += n
                taken += n
                avail -= n
            if st.off < len(dest):
                break
            st.cur = None
            st.done += len(dest)
            if f.on_done is not None:
                # Free the room first: the writer may go on while this rank reduces.
                mine[TAKEN + peer] = taken
                self.ring(peer)
                moved, start = True, taken
                f.on_done()
        if taken != start:
            mine[TAKEN + peer] = taken
            self.ring(peer)
            moved = True
        return moved

    # -- states ------------------------------------------------------------------------
    def state(self, rank: int) -> int:
        return self.words[rank][STATE]

    def reason(self, rank: int) -> tuple[bytes, str, int]:
        """What ``rank`` published when it stopped: (reason, error class, origin rank)."""
        b = self.bytes[rank]
        reason = bytes(b[REASON_AT:]).split(b"\0", 1)[0]
        error = bytes(b[ERROR_AT:REASON_AT]).split(b"\0", 1)[0].decode("ascii", "replace")
        return reason, error, self.words[rank][ORIGIN]

    def publish(self, state: int, reason: str = "", error: str = "", origin: int = -1) -> None:
        """Set this rank's state (the first one other than OPEN sticks), then wake everyone,
        this rank too (an exchange of its own in another thread)."""
        words, b = self.words[self.me], self.bytes[self.me]
        if words[STATE] == OPEN:
            if state == ABORTED:
                data = reason.encode("utf-8", "replace")[:PAGE - REASON_AT - 1] + b"\0"
                b[REASON_AT:REASON_AT + len(data)] = data
                name = error.encode("ascii", "replace")[:REASON_AT - ERROR_AT - 1] + b"\0"
                b[ERROR_AT:ERROR_AT + len(name)] = name
                words[ORIGIN] = origin
            words[STATE] = state   # after the reason: a peer that sees the state reads it whole
        for peer in range(len(self.words)):
            self.ring(peer)
