"""Frame headers on the wire, sans-I/O: encode to bytes, decode from bytes, nothing else.

A frame is ``<u32 header length> <msgpack header> <payload>``. The header says what the
payload is: which collective (and its sequence number, dtype, element count, reduce op and
root, so that ranks calling different collectives detect it from the first header), which
step and segment of the schedule, and how many payload bytes follow. The payload is raw
tensor memory: nothing from the wire is ever unpickled.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from pycoll.errors import ProtocolError

MAGIC = 0x7C01  # protocol version 1
PREFIX = struct.Struct("<I")
MAX_HEADER_BYTES = 512

# Frame kinds
DATA = 0
ABORT = 1   # "I stopped": payload is the UTF-8 reason; sig.redop names the error class,
            # sig.root the rank where the failure started (it may have been relayed)
BYE = 2     # "I destroyed my group cleanly": the last frame a rank sends on a connection

MAX_CONTROL_BYTES = 4096  # bound on an ABORT/BYE payload: a receiver never reads more


# The one encoding of "which collective is this": a Signature in a TCP header, packed into
# integer words in shared memory (``pack``/``unpack``), named in traces and errors.
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
       "all_to_all", "barrier")
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")
DTYPE_SIZES = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
               "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16}
REDOPS = ("", "sum", "product", "min", "max", "band", "bor", "bxor", "avg", "premul_sum")
OP_WORD, DTYPE_WORD, REDOP_WORD = ({v: i for i, v in enumerate(names)} for names in (OPS, DTYPES, REDOPS))


@dataclass(frozen=True, slots=True)
class Signature:
    """What a collective call is; every rank of one call must agree on all of it."""

    op: str
    seq: int
    dtype: str
    numel: int
    redop: str = ""
    root: int = -1

    def describe(self) -> str:
        extra = "".join(
            [f", op={self.redop}" if self.redop else "", f", root={self.root}" if self.root >= 0 else ""]
        )
        return f"{self.op}(seq={self.seq}, dtype={self.dtype}, numel={self.numel}{extra})"


def pack(sig: Signature, extra: int = 0) -> tuple[int, ...]:
    """``sig`` as the 7 integer words a shared-memory collective publishes (``extra``: a word
    of the collective's own, e.g. a hash of reduce_scatter's counts)."""
    return (OP_WORD[sig.op], sig.seq, DTYPE_WORD[sig.dtype], sig.numel, REDOP_WORD[sig.redop], sig.root, extra)


def unpack(words: tuple[int, ...]) -> Signature | None:
    """The Signature a rank's words stand for; None for words that are no collective."""
    op, seq, dt, numel, red, root = words[:6]
    if not (0 <= op < len(OPS) and 0 <= dt < len(DTYPES) and 0 <= red < len(REDOPS)):
        return None
    return Signature(OPS[op], seq, DTYPES[dt], numel, REDOPS[red], root)


def nbytes(sig: Signature) -> int:
    """Bytes of the message a signature describes (numel x the dtype's size)."""
    return sig.numel * DTYPE_SIZES[sig.dtype]


@dataclass(frozen=True, slots=True)
class Header:
    kind: int
    sig: Signature
    step: int
    seg: int
    nbytes: int

    def encode(self) -> bytes:
        s = self.sig
        body = msgpack.packb(
            [MAGIC, self.kind, s.op, s.seq, s.dtype, s.numel, s.redop, s.root,
             self.step, self.seg, self.nbytes],
            use_bin_type=True,
        )
        return PREFIX.pack(len(body)) + body


def header_length(prefix: bytes | memoryview) -> int:
    """Length of the header that follows a 4-byte prefix; rejects absurd lengths."""
    (n,) = PREFIX.unpack(prefix)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise ProtocolError(f"invalid frame header length {n} (max {MAX_HEADER_BYTES})")
    return n


def decode_header(body: bytes | memoryview) -> Header:
    """Parse a header body; any malformed input raises ProtocolError, never anything else."""
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0,
                                 max_array_len=16, max_map_len=0, max_str_len=64)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"undecodable frame header: {exc}") from None
    if not isinstance(fields, list) or len(fields) != 11 or fields[0] != MAGIC:
        raise ProtocolError(f"not a pycoll frame header: {fields!r:.80}")
    _, kind, op, seq, dtype, numel, redop, root, step, seg, nbytes = fields
    ints = (kind, seq, numel, root, step, seg, nbytes)
    if not all(type(v) is int for v in ints) or not all(type(v) is str for v in (op, dtype, redop)):
        raise ProtocolError(f"ill-typed frame header: {fields!r:.80}")
    if nbytes < 0 or numel < 0:
        raise ProtocolError(f"negative size in frame header: {fields!r:.80}")
    return Header(kind, Signature(op, seq, dtype, numel, redop, root), step, seg, nbytes)


def control_frame(kind: int, reason: str = "", origin: int = -1, error: str = "") -> bytes:
    """An ABORT or BYE frame (header plus reason), bounded to ``MAX_CONTROL_BYTES``."""
    payload = reason.encode("utf-8", "replace")[:MAX_CONTROL_BYTES]
    sig = Signature("control", -1, "", 0, error[:64], origin)
    return Header(kind, sig, 0, 0, len(payload)).encode() + payload


def control_payload_length(hdr: Header) -> int:
    """Payload bytes of a control frame; a claim above the bound is a protocol error."""
    if not 0 <= hdr.nbytes <= MAX_CONTROL_BYTES:
        raise ProtocolError(f"control frame claims {hdr.nbytes} payload bytes (max {MAX_CONTROL_BYTES})")
    return hdr.nbytes
