"""Point-to-point with ranks of other hosts: the engine's messages as frames on a socket.

The bytes side of ``P2PEngine`` (``p2p.py``) for a peer reached over TCP, as ``p2p_local``
is for a peer of this host: write the queued sends' frames as far as the non-blocking
socket takes them, read arriving frames into the receives the engine matches them with
(or into unexpected buffers), and end the stream with a reason when this rank stops
reading a peer. Each function is called by the engine holding its lock.
"""

from __future__ import annotations

import socket

from pycoll.errors import ProtocolError
from pycoll.transport.base import control_error
from pycoll.transport.frames import control_reason, next_frame
from pycoll.transport.tcp.p2p_requests import Message, write
from pycoll.wire import ABORT, BYE, DATA, Header, control_frame


def progress_send(engine, p: int) -> None:
    q, sock = engine._sends[p], engine.conns[p].sock
    while q:
        try:
            if not write(sock, q[0]):
                return
        except BlockingIOError:
            return
        engine._finish(q.popleft())


def progress_recv(engine, p: int) -> None:
    conn, rank = engine.conns[p], engine.rank
    while True:
        inc = engine._reading.get(p)
        if inc is None:
            what = engine._what[p]
            nxt = next_frame(conn, rank, p, what)
            if nxt is not None:
                if nxt.header.kind == DATA:
                    conn.rpos = nxt.start
                    engine._reading[p] = engine._match(p, message(rank, p, nxt.header))
                    continue
                # A control frame (the peer stopped, and says why): raise its reason.
                reason = control_reason(conn.rbuf, nxt, conn.rend, False)
                if reason is not None:
                    if nxt.header.kind == BYE:
                        engine._left.add(p)
                    raise control_error(nxt.header, reason, rank, p, what)
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
        del engine._reading[p]
        engine._arrived(p, inc)


def tell_peer(engine, p: int, exc: BaseException) -> None:
    """This rank stops reading from ``p`` because of what ``p`` sent: say why in an ABORT
    frame and end the stream, so that ``p`` fails at once instead of at its deadline."""
    conn, q = engine.conns[p], engine._sends[p]
    try:
        if not (q and q[0].off):   # never inside a half-written frame of our own
            conn.sock.send(control_frame(ABORT, str(exc), engine.rank, type(exc).__name__))
        conn.sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def message(rank: int, p: int, hdr: Header) -> Message:
    """The message a wire header announces (a frame of another kind is a protocol error)."""
    if hdr.kind != DATA or hdr.sig.op != "p2p":
        raise ProtocolError(f"rank {rank}: non-p2p frame on the p2p channel from rank {p}", rank=rank, peer=p)
    return Message(hdr.sig.seq, hdr.sig.dtype, hdr.sig.numel, hdr.nbytes)
