"""The sans-I/O frame reader and the one signature encoding, without sockets."""

from __future__ import annotations

import struct

import pytest

from pycoll import wire
from pycoll.errors import ProtocolError
from pycoll.transport.frames import control_reason, frames, garbage, header_at
from pycoll.wire import ABORT, BYE, DATA, Header, Signature, control_frame

SIG = Signature("all_reduce", 3, "float32", 4, "sum")


def _stream(*parts: bytes) -> memoryview:
    return memoryview(b"".join(parts))


def test_a_header_is_read_only_once_all_of_it_is_there():
    frame = Header(DATA, SIG, 0, 0, 16).encode() + bytes(16)
    hlen = len(Header(DATA, SIG, 0, 0, 16).encode())
    for cut in range(hlen):
        assert header_at(memoryview(frame), 0, cut) is None
    parsed = header_at(memoryview(frame), 0, hlen)
    assert parsed.header.sig == SIG and parsed.start == hlen and parsed.end == hlen + 16


def test_frames_walks_whole_frames_and_stops_at_a_partial_one():
    a = Header(DATA, SIG, 0, 0, 8).encode() + bytes(8)
    b = Header(DATA, SIG, 1, 0, 4).encode() + bytes(4)
    c = control_frame(ABORT, "rank 2 died", 2, "PeerClosedError")
    buf = _stream(a, b, c)
    got = list(frames(buf, 0, len(buf)))
    assert [f.header.kind for f in got] == [DATA, DATA, ABORT]
    assert control_reason(buf, got[2], len(buf), eof=False) == b"rank 2 died"
    # cut inside the ABORT's reason: the frame is seen, its reason is not complete yet
    short = len(a) + len(b) + len(c) - 3
    last = list(frames(buf, 0, short))[-1]
    assert last.header.kind == ABORT and control_reason(buf, last, short, eof=False) is None
    assert control_reason(buf, last, short, eof=True) == b"rank 2 d"
    # a data payload running past the end: nothing after it is parsed
    assert len(list(frames(buf, 0, len(a) - 1))) == 1


def test_bye_has_no_reason():
    buf = memoryview(control_frame(BYE))
    (f,) = frames(buf, 0, len(buf))
    assert f.header.kind == BYE and control_reason(buf, f, len(buf), eof=False) == b""


@pytest.mark.parametrize("bad,text", [
    (struct.pack("<I", 0xFFFFFFF0) + b"x" * 8, "invalid frame header length"),
    (struct.pack("<I", 5) + b"\xc1" * 5, "undecodable frame header"),
    (Header(ABORT, SIG, 0, 0, wire.MAX_CONTROL_BYTES + 1).encode(), "control frame claims"),
])
def test_garbage_is_a_protocol_error_named_by_the_reader(bad, text):
    with pytest.raises(ProtocolError, match=text) as info:
        header_at(memoryview(bad), 0, len(bad))
    named = garbage(0, 1, "all_reduce seq 3", info.value)
    assert str(named).startswith("all_reduce seq 3: rank 0 got garbage from rank 1: ") and named.peer == 1


def test_a_signature_packs_into_shared_memory_words_and_back():
    for sig in (SIG, Signature("broadcast", 7, "bfloat16", 0, "", 2), Signature("barrier", 0, "uint8", 0)):
        words = wire.pack(sig, extra=5)
        assert len(words) == 7 and words[6] == 5 and wire.unpack(words) == sig
    assert wire.unpack((99, 0, 0, 0, 0, -1, 0)) is None
    assert wire.nbytes(SIG) == 16


def test_encoded_header_reads_back_what_a_frame_header_says():
    from pycoll.errors import ProtocolError
    from pycoll.transport.frames import encoded_header
    from pycoll.wire import DATA, Header, Signature

    hdr = Header(DATA, Signature("all_reduce", 3, "float32", 10, "sum"), 1, 0, 40)
    assert encoded_header(hdr.encode()) == hdr
    with pytest.raises(ProtocolError, match="not a whole frame header"):
        encoded_header(hdr.encode()[:-1])
