"""Point-to-point links between the ranks of one host: a ring of bytes per ordered pair.

What NCCL's SHM transport and Open MPI's vader do for one host, for pycoll's point-to-point
engine (``transport/tcp/p2p.py``): a message to a rank of this host never touches a socket.
This module moves bytes and reads and writes the words that describe them; it never waits
(the engine and its callers do).

Layout of the segment (one memfd, ``segment.map_segment``: nothing named, nothing to leak):
one region per local rank, a 64 KiB page of its words followed by its rings to every local
rank. A ring has one writer (the region's rank) and one reader, and carries the pair's
messages in posting order, each a 32-byte header (magic, dtype, tag, element count, bytes)
and its payload; a payload larger than the ring goes through it in pieces as the reader
takes them, straight from the sender's tensor into the receiver's (no message-sized staging
copy). A rank's page holds, each word with one writer:

- ``SENT[peer]``, ``TAKEN[peer]``: bytes written to, and taken from, each peer. x86 keeps a
  writer's stores in order, so a reader that sees a counter sees the bytes before it;
- ``BLOCKED[peer]``: set while this rank has bytes for ``peer`` that did not fit;
- ``DRIVING``: how many threads of this rank wait on its rings in their own thread (a
  blocking receive or send: ``Work.wait``), ``SLEEPING`` how many of those sleep on its
  ``DOORBELL`` (a futex word, one byte lane per writer mod 4, as ``testing/mailbox.py``);
  ``STATE`` (open, closed) and ``BROKEN[peer]`` (it stopped reading ``peer``: a malformed
  header);
- ``PID`` and ``BELL``: its pid and its engine's wake pipe, which a peer opens through
  /proc/<pid>/fd and writes a byte to, as the engine's own sockets would wake its poll.

A rank that changes a counter a peer may wait on (``notify``) tells nobody while a thread of
the peer polls (a ping-pong between two ranks in step makes no system call), wakes its
sleeping threads through the doorbell, and its engine's thread through the pipe when no
thread of its waits in its own. Each check is a store (the counter) then a load (the
peer's words) against the peer's store (its words) then load (the counter): x86 may reorder
a store with a later load, so both sides put a locked instruction between them (``fence``).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time

from pycoll import rendezvous
from pycoll.errors import CommTimeoutError, ProtocolError
from pycoll.shm import futex, segment
from pycoll.transport.tcp.p2p_requests import Message
from pycoll.wire import DTYPE_SIZES, DTYPE_WORD, DTYPES

# A rank's page and every ring are multiples of 64 KiB, and so is the segment: a mapping of
# another size shifts where the process's later mappings land off 64 KiB boundaries, and the
# registered heap's unmapping of peers' pages follows the kernel's 64 KiB fault-around
# windows by offset (pycoll/shm/heap.py), which then no longer match its addresses (seen:
# test_heap_reuse kept 40-88 pages too many after a point-to-point test in the same process).
ALIGN = 64 << 10
PAGE = ALIGN
MAX_RANKS = 128
SENT, TAKEN, BLOCKED, BROKEN = 0, 128, 256, 384     # int64 word arrays of a rank's page, by peer
DOORBELL, DRIVING, SLEEPING, STATE, PID, BELL, WATCHING = 512, 513, 514, 515, 516, 517, 518   # int64 words
REASON_AT, REASON_BYTES = 5120, 4096   # why this rank first stopped reading a peer (text)
OPEN, CLOSED = 0, 1
HEADER = struct.Struct("<IiqqQ")                     # magic, dtype, tag, numel, nbytes
MAGIC = 0x50325031                                   # "1P2P"
RING_TOTAL = 32 << 20    # rings' bytes per rank at most (the pages are touched only when used)
RING_MAX, RING_MIN = 4 << 20, 64 << 10
CHUNK = 256 << 10        # bytes copied between two counter updates: the two sides overlap

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: acquiring a lock is a locked instruction on x86."""
    _fence_lock.acquire()
    _fence_lock.release()


def ring_bytes(size: int) -> int:
    """Each ring's bytes for ``size`` local ranks: 4 MiB for two, less as rings multiply."""
    per = RING_TOTAL // max(1, size - 1)
    return max(RING_MIN, min(RING_MAX, per)) // ALIGN * ALIGN


def header(tag: int, dtype: str, numel: int, nbytes: int) -> bytes:
    return HEADER.pack(MAGIC, DTYPE_WORD[dtype], tag, numel, nbytes)


def parse(raw: bytes, rank: int, peer: int) -> Message:
    """The message a header announces; a ProtocolError for one that no pycoll rank writes."""
    magic, dt, tag, numel, nbytes = HEADER.unpack(raw)
    if magic != MAGIC or not 0 <= dt < len(DTYPES) or numel < 0 or nbytes != numel * DTYPE_SIZES[DTYPES[dt]]:
        raise ProtocolError(f"rank {rank}: malformed point-to-point header from rank {peer} on the shared-memory "
                            f"link (magic {magic:#x}, dtype {dt}, numel {numel}, bytes {nbytes})",
                            op="recv", rank=rank, peer=peer)
    return Message(tag, DTYPES[dt], numel, nbytes)


class Links:
    """This rank's rings to and from the other ranks of its host (group ranks ``ranks``)."""

    def __init__(self, store, key: str, ranks: list[int], me: int, wake_fd: int, timeout: float) -> None:
        self.ranks, self.size = ranks, len(ranks)
        if self.size > MAX_RANKS:
            raise ValueError(f"shared-memory point-to-point serves at most {MAX_RANKS} ranks of a host")
        self.local = {g: i for i, g in enumerate(ranks)}        # group rank -> local index
        self.me = self.local[me]
        self.ring = m = ring_bytes(self.size)
        region = PAGE + self.size * m
        deadline = time.monotonic() + timeout
        self.mm, _ = segment.map_segment(store, key, self.me, self.size, self.size * region, deadline,
                                         "point-to-point init", "p2p")
        mv = memoryview(self.mm)
        self._views = [mv]
        starts = [i * region for i in range(self.size)]
        self._pages = [self._keep(mv[s:s + PAGE]) for s in starts]
        self.words = [self._keep(mv[s:s + PAGE].cast("q")) for s in starts]
        self._lanes = [self._keep(mv[s + DOORBELL * 8:s + DOORBELL * 8 + 4]) for s in starts]
        self._doorbell = self._keep(mv[starts[self.me] + DOORBELL * 8:starts[self.me] + DOORBELL * 8 + 4].cast("I"))
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self._doorbell_at = [ctypes.c_void_p(base + s + DOORBELL * 8) for s in starts]
        self._lane = self.me % 4
        self._out = [self._keep(mv[starts[self.me] + PAGE + i * m:starts[self.me] + PAGE + (i + 1) * m])
                     for i in range(self.size)]
        self._in = [self._keep(mv[s + PAGE + self.me * m:s + PAGE + (self.me + 1) * m]) for s in starts]
        mine = self.words[self.me]
        mine[BELL] = wake_fd
        mine[PID] = os.getpid()   # last: a peer that sees the pid reads the bell's number too
        self._bells: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        for i in range(self.size):   # every peer's pid, for the engine's watch on it
            while not self.words[i][PID]:
                rendezvous.check_watch()
                if time.monotonic() > deadline:
                    raise CommTimeoutError(f"point-to-point init: local rank {i} (rank {ranks[i]}) did not "
                                           f"publish its pid in time ({key})", peer=ranks[i])
                time.sleep(0.0005)
            self.pids[ranks[i]] = self.words[i][PID]
        self.pids.pop(me)

    def _keep(self, view: memoryview) -> memoryview:
        self._views.append(view)
        return view

    header = staticmethod(header)

    def peers(self) -> list[int]:
        return [g for g in self.ranks if self.local[g] != self.me]

    # -- waking a peer ---------------------------------------------------------------
    def notify(self, peer: int, urgent: bool = True) -> None:
        """``peer`` may wait on a counter this rank just changed (call after the store).
        A message that is all in (not ``urgent``) needs the peer's engine only where the
        peer ``WATCHING`` something without polling: else it waits in the ring for the
        peer's next call, which looks at the rings first (MPI's progress-in-calls); a send
        left waiting for room is urgent (the peer's engine makes the room)."""
        fence()
        i = self.local[peer]
        w = self.words[i]
        if w[SLEEPING]:
            self.ring_doorbell(i)
        elif w[DRIVING] == 0 and (urgent or w[WATCHING]):
            self.ring_bell(i)

    def ring_doorbell(self, i: int) -> None:
        lanes = self._lanes[i]
        lanes[self._lane] = (lanes[self._lane] + 1) & 0xFF
        futex.wake(self._doorbell_at[i])

    def wake_self(self) -> None:
        """Wake this rank's own threads asleep on its doorbell (the engine failed a request)."""
        self.ring_doorbell(self.me)

    def doorbell(self) -> int:
        """The doorbell's value, read before a last look at the rings and a ``sleep``."""
        return self._doorbell[0]

    def sleep(self, seen: int, seconds: float) -> None:
        """Sleep while the doorbell holds ``seen``, at most ``seconds``."""
        futex.wait(self._doorbell_at[self.me].value, seen, seconds)

    def ring_bell(self, i: int) -> None:
        fd = self._bells.get(i)
        if fd is None:
            try:
                fd = os.open(f"/proc/{self.words[i][PID]}/fd/{self.words[i][BELL]}",
                             os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return   # the peer is gone: its death, not a lost wake-up, is what we will see
            self._bells[i] = fd
        try:
            os.write(fd, b"s")
        except OSError:   # full (it will wake anyway) or the peer closed it
            pass

    def driving(self, delta: int) -> None:
        """This rank's count of threads waiting on its rings in their own thread (call
        holding the engine's lock); a thread that stops must look at its rings once more
        afterwards (``fence`` between): a peer that saw it there did not ring the engine."""
        self.words[self.me][DRIVING] += delta
        fence()

    def watching(self, delta: int) -> None:
        """This rank's count of requests someone waits for without polling (a future of
        a receive, an engine-level wait): every message for it then rings its engine."""
        self.words[self.me][WATCHING] += delta
        fence()

    def sleeping(self, delta: int) -> None:
        """This rank's count of threads asleep on its doorbell (call holding the engine's
        lock); one that goes to sleep reads the doorbell, then looks at its rings once more."""
        self.words[self.me][SLEEPING] += delta
        fence()

    # -- sending ---------------------------------------------------------------------
    def write(self, peer: int, req) -> bool:
        """Copy what the ring to ``peer`` has room for of ``req``'s header and payload (from
        ``req.off`` on); True once all of it is in. Rings the peer when anything moved."""
        i = self.local[peer]
        ring, m = self._out[i], self.ring
        mine = self.words[self.me]
        sent = mine[SENT + i]
        free = m - (sent - self.words[i][TAKEN + self.me])
        hl = len(req.header)
        total = hl + len(req.buf)
        start = sent
        while free > 0 and req.off < total:
            src = req.header[req.off:] if req.off < hl else req.buf[req.off - hl:]
            pos = sent % m
            n = min(free, len(src), m - pos, CHUNK)
            ring[pos:pos + n] = src[:n]
            sent += n
            free -= n
            req.off += n
            mine[SENT + i] = sent   # piece by piece: the reader copies one while this writes the next
        if sent != start:
            self.notify(peer, req.off < total)
        return req.off == total

    def blocked(self, peer: int, flag: bool) -> None:
        """Say whether bytes for ``peer`` wait for room (the reader then rings when it takes)."""
        self.words[self.me][BLOCKED + self.local[peer]] = int(flag)
        if flag:
            fence()

    # -- receiving -------------------------------------------------------------------
    def unread(self, peer: int) -> int:
        i = self.local[peer]
        return self.words[i][SENT + self.me] - self.words[self.me][TAKEN + i]

    def next_message(self, peer: int, rank: int) -> Message | None:
        """The header of the next message from ``peer`` once all of it is in (taken off
        the ring), else None."""
        if self.unread(peer) < HEADER.size:
            return None
        i = self.local[peer]
        m, at = self.ring, self.words[self.me][TAKEN + i]
        pos = at % m
        src = self._in[i]
        raw = bytes(src[pos:pos + HEADER.size]) if pos + HEADER.size <= m else \
            bytes(src[pos:]) + bytes(src[:HEADER.size - (m - pos)])
        msg = parse(raw, rank, peer)
        self._take(i, at + HEADER.size)
        return msg

    def read_into(self, peer: int, dest, want: int) -> int:
        """Copy up to ``want`` bytes from ``peer``'s ring into ``dest`` (a memoryview; None
        drops them); how many moved."""
        i = self.local[peer]
        m, src = self.ring, self._in[i]
        at = taken = self.words[self.me][TAKEN + i]
        avail = min(want, self.words[i][SENT + self.me] - taken)
        off = 0
        mine = self.words[self.me]
        while off < avail:
            pos = at % m
            n = min(avail - off, m - pos, CHUNK)
            if dest is not None:
                dest[off:off + n] = src[pos:pos + n]
            off += n
            at += n
            mine[TAKEN + i] = at   # piece by piece: the writer refills while this copies on
        if off:
            self._take(i, at)
        return off

    def _take(self, i: int, taken: int) -> None:
        self.words[self.me][TAKEN + i] = taken
        if self.words[i][BLOCKED + self.me]:
            self.notify(self.ranks[i])

    # -- states ----------------------------------------------------------------------
    def closed(self, peer: int) -> bool:
        return self.words[self.local[peer]][STATE] == CLOSED

    def broke_with(self, peer: int) -> str | None:
        """Why ``peer`` stopped reading this rank, if it did (what it found in a message)."""
        i = self.local[peer]
        if not self.words[i][BROKEN + self.me]:
            return None
        page = self._pages[i]
        return bytes(page[REASON_AT:REASON_AT + REASON_BYTES]).split(b"\0", 1)[0].decode("utf-8", "replace")

    def break_with(self, peer: int, reason: str) -> None:
        """Stop reading ``peer``, and tell it why (the first reason stays)."""
        mine = self.words[self.me]
        if not any(mine[BROKEN + i] for i in range(self.size)):
            data = reason.encode("utf-8", "replace")[:REASON_BYTES - 1] + b"\0"
            self._pages[self.me][REASON_AT:REASON_AT + len(data)] = data
        mine[BROKEN + self.local[peer]] = 1   # after the reason: a peer that sees it reads it whole
        self.notify(peer)

    def close(self) -> None:
        """Say goodbye (every peer's engine is rung), then drop the mapping and the bells."""
        self.words[self.me][STATE] = CLOSED
        fence()
        for i in range(self.size):
            if i != self.me:
                self.ring_bell(i)
        for fd in self._bells.values():
            os.close(fd)
        self._bells.clear()
        for view in reversed(self._views):
            view.release()
        self._views.clear()
        self.mm.close()
