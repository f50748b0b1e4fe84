"""Frames in a connection's read-ahead buffer, sans I/O (h11's receive buffer is the model).

A frame is ``<u32 length> <msgpack header> <payload>`` (``wire``). The TCP data path, its
failure handling and the point-to-point engine all read frames out of the same kind of
buffer (``tcp.conn.Conn``: ``rbuf[rpos:rend]``); these functions say what is there, and
nothing more: whether a whole header has arrived and what it says, whether a control frame's
reason is complete, which frames a buffer holds. Garbage raises ``ProtocolError`` with
the words every reader uses (``garbage``). No socket is touched.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

from pycoll.errors import ProtocolError
from pycoll.wire import (
    DATA,
    Header,
    control_payload_length,
    decode_header,
    header_length,
)


class Parsed(NamedTuple):
    header: Header
    start: int     # where the payload begins in the buffer
    end: int       # where the frame ends (start + its payload length, bounded for control frames)


def garbage(rank: int, peer: int, what: str, exc: ProtocolError) -> ProtocolError:
    """The error a rank raises on bytes from ``peer`` that are not a pycoll frame."""
    return ProtocolError(f"{what}: rank {rank} got garbage from rank {peer}: {exc}", rank=rank, peer=peer)


def header_at(buf, pos: int, end: int) -> Parsed | None:
    """The frame whose header starts at ``buf[pos]``, if the whole header is in ``buf[:end]``;
    None if more bytes are needed. Raises ProtocolError (bare: callers add who sent it)."""
    if end - pos < 4:
        return None
    hlen = header_length(buf[pos:pos + 4])
    if end - pos < 4 + hlen:
        return None
    hdr = decode_header(buf[pos + 4:pos + 4 + hlen])
    start = pos + 4 + hlen
    size = hdr.nbytes if hdr.kind == DATA else control_payload_length(hdr)
    return Parsed(hdr, start, start + size)


def encoded_header(encoded) -> Header:
    """The Header of a frame header as it goes on the wire (length prefix included): what an
    outgoing frame says, read back. Raises ProtocolError if it is not one."""
    parsed = header_at(encoded, 0, len(encoded))
    if parsed is None:
        raise ProtocolError(f"{len(encoded)} bytes are not a whole frame header")
    return parsed.header


def control_reason(buf, parsed: Parsed, end: int, eof: bool) -> bytes | None:
    """A control frame's payload once all of it is in ``buf[:end]`` (or, at end of stream,
    what did arrive); None while more may come."""
    if end >= parsed.end or eof:
        return bytes(buf[parsed.start:min(end, parsed.end)])
    return None


def frames(buf, pos: int, end: int) -> Iterator[Parsed]:
    """Every frame whose header is complete in ``buf[pos:end]``, in order (a data frame's
    payload may run past ``end``: the next frame then starts beyond what is here)."""
    while True:
        parsed = header_at(buf, pos, end)
        if parsed is None:
            return
        yield parsed
        if parsed.end > end:
            return
        pos = parsed.end


def next_frame(conn, rank: int, peer: int, what: str) -> Parsed | None:
    """``header_at`` the front of a connection's read-ahead buffer, garbage named."""
    try:
        return header_at(conn.rbuf, conn.rpos, conn.rend)
    except ProtocolError as exc:
        raise garbage(rank, peer, what, exc) from None
