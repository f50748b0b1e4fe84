"""The mutual HMAC handshake of a new TCP connection, sans I/O: bytes in, bytes out.

Like h11, this does no I/O: the mesh builder feeds it what it reads and sends what it
produces, so one poll loop can drive many handshakes at once, each under its own deadline.

    client (higher rank)                     server (lower rank)
    hello [rank, channel, cnonce]      ->
                                       <-    challenge [rank, snonce + MAC_S(cnonce)]
    proof [MAC_C(snonce)]              ->
                                       <-    ok

Each message is ``<u32 length> <msgpack list>`` of at most ``MAX_MSG`` bytes; the MACs bind
both ranks and the channel, and each side's nonce is fresh, so neither a replayed nor a
relayed handshake proves anything. Any deviation raises AuthenticationError.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

import msgpack

from pycoll.errors import AuthenticationError

MAGIC = "pycoll-tcp-1"
MAX_MSG = 256
_LEN = struct.Struct("<I")


def _mac(secret: bytes, role: bytes, nonce: bytes, a: int, b: int, channel: int) -> bytes:
    return hmac.new(secret, role + nonce + struct.pack("<qqq", a, b, channel), hashlib.sha256).digest()


def encode(obj: list) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _decode(body: bytes) -> list:
    try:
        obj = msgpack.unpackb(body, raw=False, max_array_len=8, max_map_len=0, max_bin_len=64,
                              max_str_len=64)
    except Exception as exc:  # msgpack raises several types for garbage
        raise AuthenticationError(f"undecodable handshake message: {exc}") from None
    if not isinstance(obj, list) or not obj or obj[0] != MAGIC:
        raise AuthenticationError("not a pycoll handshake")
    return obj


class Handshake:
    """One side of one connection's handshake.

    ``peer is None``: the server side, which learns the peer and channel from the hello.
    Read ``outgoing`` (and clear what was sent), feed ``receive``; ``done`` once the peer
    is authenticated and nothing is left to send.
    """

    def __init__(self, secret: bytes, rank: int, world: int, channels: int,
                 peer: int | None = None, channel: int | None = None) -> None:
        self.secret, self.rank, self.world, self.channels = secret, rank, world, channels
        self.peer, self.channel = peer, channel
        self.client = peer is not None
        self.outgoing = bytearray()
        self._buf = bytearray()
        self._nonce = secrets.token_bytes(16)
        self._authenticated = False
        if self.client:
            self.outgoing += encode([MAGIC, "hello", rank, channel, self._nonce])
            self._expect = "challenge"
        else:
            self._expect = "hello"

    @property
    def done(self) -> bool:
        return self._authenticated and not self.outgoing

    def wanted(self) -> int:
        """How many bytes to read next: never more than the current message, because what
        follows the last one on the socket is the peer's first data frame, not ours to take."""
        if self._expect == "nothing":
            return 0
        if len(self._buf) < 4:
            return 4 - len(self._buf)
        (n,) = _LEN.unpack_from(self._buf)
        return max(1, 4 + min(n, MAX_MSG + 1) - len(self._buf))

    def receive(self, data: bytes) -> None:
        """Bytes read from the peer; raises AuthenticationError on anything unexpected."""
        self._buf += data
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_MSG:
                raise AuthenticationError(f"handshake message too long ({n} bytes)")
            if len(self._buf) < 4 + n:
                return
            body, self._buf = bytes(self._buf[4:4 + n]), self._buf[4 + n:]
            self._step(_decode(body))

    def _step(self, msg: list) -> None:
        expect = self._expect
        if expect == "hello":
            if len(msg) != 5 or msg[1] != "hello" or type(msg[2]) is not int or type(msg[3]) is not int:
                raise AuthenticationError("malformed hello")
            _, _, peer, channel, cnonce = msg
            if not (self.rank < peer < self.world) or not 0 <= channel < self.channels:
                raise AuthenticationError(f"hello from invalid rank {peer!r} (channel {channel!r})")
            if not isinstance(cnonce, bytes) or len(cnonce) != 16:
                raise AuthenticationError("malformed hello nonce")
            self.peer, self.channel = peer, channel
            self.outgoing += encode([MAGIC, "challenge", self.rank,
                                     self._nonce + _mac(self.secret, b"S", cnonce, self.rank, peer, channel)])
            self._expect = "proof"
        elif expect == "challenge":
            if len(msg) != 4 or msg[1] != "challenge" or msg[2] != self.peer or not isinstance(msg[3], bytes):
                raise AuthenticationError(f"unexpected handshake reply from rank {self.peer}")
            snonce, smac = msg[3][:16], msg[3][16:]
            if not hmac.compare_digest(smac, _mac(self.secret, b"S", self._nonce, self.peer, self.rank,
                                                  self.channel)):
                raise AuthenticationError(f"rank {self.peer} failed to authenticate")
            self.outgoing += encode([MAGIC, "proof", _mac(self.secret, b"C", snonce, self.rank, self.peer,
                                                          self.channel)])
            self._expect = "ok"
        elif expect == "proof":
            if len(msg) != 3 or msg[1] != "proof" or not isinstance(msg[2], bytes):
                raise AuthenticationError("malformed proof")
            if not hmac.compare_digest(msg[2], _mac(self.secret, b"C", self._nonce, self.peer, self.rank,
                                                    self.channel)):
                raise AuthenticationError(f"connection claiming rank {self.peer} failed authentication")
            self.outgoing += encode([MAGIC, "ok"])
            self._authenticated = True
            self._expect = "nothing"
        elif expect == "ok":
            if msg[1:] != ["ok"]:
                raise AuthenticationError(f"rank {self.peer} rejected this rank")
            self._authenticated = True
            self._expect = "nothing"
        else:
            raise AuthenticationError("handshake message after the handshake ended")
