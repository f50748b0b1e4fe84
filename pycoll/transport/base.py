"""The transport interface: the narrow waist between schedules and bytes on a medium.

A transport moves frames (a header plus raw tensor bytes) between the ranks of one group.
Its one data-path verb is ``exchange``: post a step's sends and receives, run them
concurrently until all are done or the deadline passes. Frames between a pair of ranks
arrive in the order they were sent; a receive names its expected header, and the
transport checks the header that arrives against it before any payload byte is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import MismatchError, ProtocolError
from ..wire import ABORT, Header


@dataclass(slots=True)
class OutFrame:
    peer: int
    header: bytes          # already encoded (wire.Header.encode)
    payload: memoryview    # bytes of the source range, sent without a copy


@dataclass(slots=True)
class InFrame:
    peer: int
    expect: Header
    dest: memoryview                       # exactly expect.nbytes long
    on_done: Callable[[], None] | None = None  # runs before the next frame from this peer


def check_header(expect: Header, got: Header, rank: int, peer: int) -> None:
    """Raise a clear error when a peer's frame is not the one this rank's schedule expects."""
    if got.kind == ABORT:
        raise MismatchError(
            f"rank {peer} aborted {got.sig.describe()} while rank {rank} was in {expect.sig.describe()}",
            op=expect.sig.op, seq=expect.sig.seq, rank=rank, peer=peer)
    if got.sig != expect.sig:
        raise MismatchError(
            f"collective mismatch: rank {rank} called {expect.sig.describe()} but rank {peer} "
            f"called {got.sig.describe()}", op=expect.sig.op, seq=expect.sig.seq, rank=rank, peer=peer)
    if (got.step, got.seg, got.nbytes) != (expect.step, expect.seg, expect.nbytes):
        raise ProtocolError(
            f"{expect.sig.describe()}: rank {rank} expected step {expect.step} segment {expect.seg} "
            f"({expect.nbytes} bytes) from rank {peer} but got step {got.step} segment {got.seg} "
            f"({got.nbytes} bytes); the ranks chose different algorithms (check PYCOLL_ALGO)",
            op=expect.sig.op, seq=expect.sig.seq, rank=rank, peer=peer)


class Transport:
    """Interface; see module docstring. ``rank``/``world`` are ranks within the group."""

    rank: int
    world: int
    name: str = "abstract"

    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        """Send ``outs`` and receive ``ins`` concurrently; ``what`` names the op for errors."""
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        """Make every current and future exchange fail promptly (idempotent)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release every resource (idempotent)."""
        raise NotImplementedError
