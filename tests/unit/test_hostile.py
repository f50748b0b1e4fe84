"""Strangers and broken peers: rejected without a crash or unbounded memory.

During init the listener accepts anyone: a port scanner, random bytes, a length prefix
claiming 1 TB, a malformed hello, a hello for a rank that does not exist. Each is dropped
after a bounded read and the mesh still forms. On established connections a header
claiming 1 TB or garbage is a ProtocolError before any allocation, in the collective
transport and in the point-to-point engine. Nothing from the wire is unpickled.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist

from pycoll.errors import MismatchError, PeerClosedError, ProtocolError
from pycoll.transport.base import InFrame
from pycoll.transport.tcp.p2p import P2PEngine
from pycoll.transport.tcp.mesh import MAGIC, build_mesh
from pycoll.transport.tcp.transport import TcpTransport
from pycoll.wire import ABORT, DATA, MAX_CONTROL_BYTES, Header, Signature

pytestmark = pytest.mark.timeout(60)

TB = 1 << 40


def _hostile_clients(addr):
    """Each entry: what a stranger sends; the server must close on it."""
    hello = lambda *fields: msgpack.packb([MAGIC, "hello", *fields])  # noqa: E731
    frame = lambda body: struct.pack("<I", len(body)) + body  # noqa: E731
    return {
        "port scanner (connect, close)": None,
        "garbage bytes": b"\xde\xad\xbe\xef" * 64,
        "length prefix claiming 4 GiB": struct.pack("<I", 0xFFFFFFFF) + b"x" * 100,
        "oversized hello (1 KiB)": frame(b"\x00" * 1024),
        "malformed msgpack": frame(b"\xc1\xc1\xc1"),
        "not a pycoll hello": frame(msgpack.packb(["http", "GET /"])),
        "hello from rank 7 of 2": frame(hello(7, 0, b"n" * 16)),
        "hello with a 1 TB nonce claim": frame(b"\x95\xacpycoll-tcp-1\xa5hello\x01\x00\xc6\xff\xff\xff\xff"),
        "truncated hello": frame(hello(1, 0, b"n" * 16))[:-5],
    }


def test_strangers_at_init_are_rejected_and_the_mesh_forms():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    results: dict = {}

    def rank(r):
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
            results[r] = build_mesh(client, r, 2, 30.0, channels=2)
        except BaseException as exc:  # noqa: BLE001
            results[r] = exc

    t0 = threading.Thread(target=rank, args=(0,))
    t0.start()
    host, port = store.get("pycoll/addr/0").decode().split("|")
    rejected = {}
    for name, payload in _hostile_clients((host, int(port))).items():
        start = time.monotonic()
        s = socket.create_connection((host, int(port)), timeout=10)
        try:
            if payload is not None:
                s.sendall(payload)
                if name == "truncated hello":
                    s.shutdown(socket.SHUT_WR)
                s.settimeout(10)
                while s.recv(4096):  # the server closes on us (it may first say nothing at all)
                    pass
        except ConnectionResetError:
            pass
        finally:
            s.close()
        rejected[name] = time.monotonic() - start
    t1 = threading.Thread(target=rank, args=(1,))
    t1.start()
    t0.join(30)
    t1.join(30)
    assert not isinstance(results.get(0), BaseException) and not isinstance(results.get(1), BaseException), results
    (c0, p0), (c1, p1) = results[0], results[1]
    for a, b in ((c0[1], c1[0]), (p0[1], p1[0])):  # the accepted sockets carry bytes both ways
        a.sendall(b"ping")
        assert b.recv(4) == b"ping"
    for d in (c0, p0, c1, p1):
        for s in d.values():
            s.close()
    assert all(t < 6 for t in rejected.values()), rejected
    print("\n" + "\n".join(f"  {k}: dropped after {v * 1000:.1f} ms" for k, v in rejected.items()))


# -- established connections ------------------------------------------------------------------------

SIG = Signature("all_reduce", 3, "float32", 4, "sum")


def _tcp_pair():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        b = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
    return a, b


def _pair():
    a, b = _tcp_pair()
    return TcpTransport(0, 2, {1: a}), b


@pytest.mark.parametrize("bad,err,text", [
    (Header(DATA, SIG, 0, 0, TB).encode(), ProtocolError, "1099511627776 bytes"),
    (struct.pack("<I", 0xFFFFFFF0) + b"x" * 64, ProtocolError, "invalid frame header length"),
    (struct.pack("<I", 20) + b"\xc1" * 20, ProtocolError, "undecodable frame header"),
    (Header(DATA, Signature("broadcast", 3, "float32", 4, root=0), 0, 0, 16).encode(), MismatchError,
     "rank 1 called broadcast(seq=3"),
    (Header(ABORT, SIG, 0, 0, MAX_CONTROL_BYTES + 1).encode(), ProtocolError, "control frame claims"),
], ids=["header claims 1 TB", "length prefix 4 GiB", "undecodable header", "other collective",
        "ABORT claims 4 KiB+1"])
def test_bad_frame_on_collective_connection(bad, err, text):
    t, peer = _pair()
    dest = torch.zeros(4)
    peer.sendall(bad)
    with pytest.raises(err, match=text.replace("(", r"\(")):
        t.exchange([], [InFrame(1, Header(DATA, SIG, 0, 0, 16), memoryview(dest.numpy()).cast("B"))],
                   time.monotonic() + 5, "all_reduce seq 3")
    assert dest.eq(0).all()  # nothing was written
    t.abort("test")
    t.close()
    peer.close()


def test_truncated_frame_then_close_is_a_dead_peer():
    t, peer = _pair()
    peer.sendall(Header(DATA, SIG, 0, 0, 16).encode() + b"\x00" * 7)
    peer.close()
    with pytest.raises(PeerClosedError, match=r"rank 1 closed its connection .* \(it had sent 7 of 16 bytes"):
        t.exchange([], [InFrame(1, Header(DATA, SIG, 0, 0, 16), memoryview(bytearray(16)))],
                   time.monotonic() + 5, "all_reduce seq 3")
    t.close()


@pytest.mark.parametrize("claim", [TB, (1 << 30) + 1])
def test_p2p_unexpected_message_is_bounded(claim):
    a, b = _tcp_pair()
    eng = P2PEngine(0, 2, {1: a})
    try:
        b.sendall(Header(DATA, Signature("p2p", 5, "float32", claim // 4), 0, 0, claim).encode())
        time.sleep(0.3)
        req = eng.irecv(1, 5, memoryview(bytearray(16)), "float32", 4, time.monotonic() + 5)
        assert req.done.wait(5)
        assert isinstance(req.error, PeerClosedError) and "PYCOLL_MAX_UNEXPECTED_BYTES" in str(req.error)
    finally:
        eng.close()
        b.close()


def test_p2p_garbage_fails_only_that_peer():
    a, b = _tcp_pair()
    eng = P2PEngine(0, 2, {1: a})
    try:
        req = eng.irecv(1, 0, memoryview(bytearray(4)), "uint8", 4, time.monotonic() + 5)
        b.sendall(b"\x00\x00\x01\x00garbage!" * 8)
        assert req.done.wait(5)
        assert isinstance(req.error, PeerClosedError) and "frame header" in str(req.error)
    finally:
        eng.close()
        b.close()
