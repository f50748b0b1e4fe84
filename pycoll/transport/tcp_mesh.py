"""Building the TCP full mesh: listen, publish the address in the Store, connect, authenticate.

Rank r connects to every lower rank and accepts every higher rank, once per channel
(collectives and point-to-point traffic use separate sockets, so a large isend can never
stall a collective). Each connection runs a mutual HMAC challenge-response over a secret
drawn per group and shared through the c10d Store, so a stray client, a port scanner or a
peer of another group cannot join: it is dropped after a bounded read, and the accept loop
goes on. The listening socket is closed once the mesh is complete.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
import time

import msgpack

from .. import rendezvous
from ..errors import AuthenticationError, CommTimeoutError

log = logging.getLogger("pycoll")

MAGIC = "pycoll-tcp-1"
MAX_MSG = 256
HANDSHAKE_TIMEOUT = 5.0
_LEN = struct.Struct("<I")


def _send_msg(sock: socket.socket, obj) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise AuthenticationError("connection closed during handshake")
        got += k
    return bytes(buf)


def _recv_msg(sock: socket.socket) -> list:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_MSG:
        raise AuthenticationError(f"handshake message too long ({n} bytes)")
    try:
        obj = msgpack.unpackb(_recv_exact(sock, n), raw=False, max_array_len=8, max_map_len=0,
                              max_bin_len=64, max_str_len=64)
    except Exception as exc:
        raise AuthenticationError(f"undecodable handshake message: {exc}") from None
    if not isinstance(obj, list) or not obj or obj[0] != MAGIC:
        raise AuthenticationError("not a pycoll handshake")
    return obj


def _mac(secret: bytes, role: bytes, nonce: bytes, a: int, b: int, channel: int) -> bytes:
    return hmac.new(secret, role + nonce + struct.pack("<qqq", a, b, channel), hashlib.sha256).digest()


def _client_handshake(sock, secret, rank, peer, channel) -> None:
    nonce = secrets.token_bytes(16)
    _send_msg(sock, [MAGIC, "hello", rank, channel, nonce])
    msg = _recv_msg(sock)
    if len(msg) != 4 or msg[1] != "challenge" or msg[2] != peer:
        raise AuthenticationError(f"unexpected handshake reply from rank {peer}")
    _, _, _, snonce, smac = msg[0], msg[1], msg[2], msg[3][:16], msg[3][16:]
    if not hmac.compare_digest(smac, _mac(secret, b"S", nonce, peer, rank, channel)):
        raise AuthenticationError(f"rank {peer} failed to authenticate")
    _send_msg(sock, [MAGIC, "proof", _mac(secret, b"C", snonce, rank, peer, channel)])
    msg = _recv_msg(sock)
    if msg[1:] != ["ok"]:
        raise AuthenticationError(f"rank {peer} rejected this rank")


def _server_handshake(sock, secret, rank, world) -> tuple[int, int]:
    msg = _recv_msg(sock)
    if len(msg) != 5 or msg[1] != "hello" or type(msg[2]) is not int or type(msg[3]) is not int:
        raise AuthenticationError("malformed hello")
    _, _, peer, channel, cnonce = msg
    if not (rank < peer < world) or not isinstance(cnonce, bytes) or len(cnonce) != 16:
        raise AuthenticationError(f"hello from invalid rank {peer!r}")
    snonce = secrets.token_bytes(16)
    _send_msg(sock, [MAGIC, "challenge", rank, snonce + _mac(secret, b"S", cnonce, rank, peer, channel)])
    msg = _recv_msg(sock)
    if len(msg) != 3 or msg[1] != "proof" or not isinstance(msg[2], bytes):
        raise AuthenticationError("malformed proof")
    if not hmac.compare_digest(msg[2], _mac(secret, b"C", snonce, peer, rank, channel)):
        raise AuthenticationError(f"connection claiming rank {peer} failed authentication")
    _send_msg(sock, [MAGIC, "ok"])
    return peer, channel


def build_mesh(store, rank: int, world: int, timeout: float, channels: int = 2
               ) -> list[dict[int, socket.socket]]:
    """Connect this rank to every other rank, ``channels`` sockets per pair.

    Returns one ``{peer: socket}`` dict per channel (blocking sockets, authenticated).
    """
    deadline = time.monotonic() + timeout
    mesh: list[dict[int, socket.socket]] = [{} for _ in range(channels)]
    if world == 1:
        return mesh
    secret = rendezvous.group_secret(store, rank)
    host = rendezvous.local_address()
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(max(16, 2 * world * channels))
        port = listener.getsockname()[1]
        store.set(f"pycoll/addr/{rank}", f"{host}|{port}")
        for peer in range(rank):
            phost, pport = store.get(f"pycoll/addr/{peer}").decode().split("|")
            for ch in range(channels):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"init: rank {rank} timed out connecting to rank {peer}",
                                           op="init", rank=rank, peer=peer)
                sock = socket.create_connection((phost, int(pport)), timeout=min(left, 60))
                try:
                    _client_handshake(sock, secret, rank, peer, ch)
                except BaseException:
                    sock.close()
                    raise
                sock.settimeout(None)
                mesh[ch][peer] = sock
        expected = (world - 1 - rank) * channels
        got = 0
        while got < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted({p for p in range(rank + 1, world) for ch in range(channels)
                                  if p not in mesh[ch]})
                raise CommTimeoutError(f"init: rank {rank} timed out waiting for ranks {missing} "
                                       f"to connect", op="init", rank=rank,
                                       peer=missing[0] if missing else -1)
            listener.settimeout(left)
            try:
                sock, addr = listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(min(HANDSHAKE_TIMEOUT, max(0.1, left)))
            try:
                peer, ch = _server_handshake(sock, secret, rank, world)
                if not 0 <= ch < channels or peer in mesh[ch]:
                    raise AuthenticationError(f"duplicate connection from rank {peer}")
            except (AuthenticationError, OSError) as exc:
                log.warning("pycoll rank %d: rejected connection from %s: %s", rank, addr, exc)
                sock.close()
                continue
            sock.settimeout(None)
            mesh[ch][peer] = sock
            got += 1
    except BaseException:
        for d in mesh:
            for s in d.values():
                s.close()
        raise
    finally:
        listener.close()
    return mesh


def interface_address(ifname: str) -> str:
    """IPv4 address of a network interface (PYCOLL_SOCKET_IFNAME)."""
    import fcntl

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
    except OSError as exc:
        raise ValueError(f"PYCOLL_SOCKET_IFNAME={ifname}: no IPv4 address ({exc})") from None
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])

