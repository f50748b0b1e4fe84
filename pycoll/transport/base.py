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

from pycoll import errors
from pycoll.errors import CommError, CommTimeoutError, MismatchError, PeerClosedError, ProtocolError
from pycoll.wire import ABORT, BYE, DATA, Header


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


_RELAYED = {c.__name__: c for c in (errors.CommTimeoutError, errors.PeerClosedError,
                                     errors.MismatchError, errors.ProtocolError, errors.CommError)}


def timeout_error(what: str, rank: int, peer: int, where: str, progress: Sequence[str]) -> CommTimeoutError:
    """A wait that passed its deadline, in the same words on every transport (shared memory,
    TCP, the test transports): ``{what}: rank R timed out waiting for rank P{where}: {progress}``.
    Ranks are group ranks; ``progress`` says how far each transfer got."""
    text = f"{what}: rank {rank} timed out waiting for rank {peer}{where}"
    return CommTimeoutError(text + (": " + "; ".join(progress) if progress else ""), rank=rank, peer=peer)


def death_error(what: str, rank: int, peer: int, how: str) -> PeerClosedError:
    """A peer that died or vanished, as every transport reports it: ``{what}: rank P {how}``,
    with P as the failure's origin (what a rank relays when it aborts the others)."""
    exc = PeerClosedError(f"{what}: rank {peer} {how}", rank=rank, peer=peer)
    exc.origin = peer
    return exc


def control_error(got: Header, payload: bytes, rank: int, peer: int, what: str,
                  op: str = "", seq: int = -1) -> CommError:
    """The error a rank raises on reading a peer's ABORT or BYE frame.

    An ABORT carries the original failure's text, class and rank, so every rank of a broken
    group reports the root cause ("rank 2 died", "collective mismatch: ..."), not merely
    "rank 1 closed the connection". Only a fixed set of classes can be named; nothing from
    the wire is evaluated.
    """
    if got.kind == BYE:
        return PeerClosedError(f"{what}: rank {peer} has destroyed its process group (shutdown) "
                               f"while rank {rank} still expected data from it",
                               op=op, seq=seq, rank=rank, peer=peer)
    if got.kind != ABORT:
        return ProtocolError(f"{what}: rank {rank} got a frame of unknown kind {got.kind} from rank {peer}",
                             op=op, seq=seq, rank=rank, peer=peer)
    reason = payload.decode("utf-8", "replace") or "no reason given"
    cls = _RELAYED.get(got.sig.redop, PeerClosedError)
    exc = cls(f"{what}: rank {rank} stopped because rank {peer} aborted: {reason}",
              op=op, seq=seq, rank=rank, peer=peer)
    exc.origin = got.sig.root if got.sig.root >= 0 else peer
    exc.root_cause = reason
    return exc


def check_header(expect: Header, got: Header, rank: int, peer: int) -> None:
    """Raise a clear error when a peer's frame is not the one this rank's schedule expects."""
    if got.kind != DATA:
        raise control_error(got, b"", rank, peer, f"{expect.sig.op} seq {expect.sig.seq}",
                            expect.sig.op, expect.sig.seq)
    if got.sig != expect.sig:
        raise MismatchError(
            f"collective mismatch: rank {rank} called {expect.sig.describe()} but rank {peer} "
            f"called {got.sig.describe()}", op=expect.sig.op, seq=expect.sig.seq, rank=rank, peer=peer)
    if (expect.sig.op == "all_to_all" and (got.step, got.seg) == (expect.step, expect.seg)
            and got.nbytes != expect.nbytes):
        # Per-pair sizes are in no signature: the frame's byte count is where they show.
        raise MismatchError(
            f"{expect.sig.describe()}: split sizes disagree: rank {peer} sent {got.nbytes} bytes "
            f"(step {got.step} segment {got.seg}) to rank {rank}, which expects {expect.nbytes}",
            op=expect.sig.op, seq=expect.sig.seq, rank=rank, peer=peer)
    if (got.step, got.seg, got.nbytes) != (expect.step, expect.seg, expect.nbytes):
        raise ProtocolError(
            f"{expect.sig.describe()}: rank {rank} expected step {expect.step} segment {expect.seg} "
            f"({expect.nbytes} bytes) from rank {peer} but got step {got.step} segment {got.seg} "
            f"({got.nbytes} bytes); the ranks chose different algorithms (check PYCOLL_ALGO)",
            op=expect.sig.op, seq=expect.sig.seq, rank=rank, peer=peer)


class Transport:
    """Interface; see module docstring. ``rank``/``world`` are ranks within the group.

    The contract, which the conformance kit (pycoll/testing/conformance.py) checks on every
    transport:

    - Frames between a pair arrive in the order sent, across exchanges; the two ends need
      not group a pair's frames into exchanges the same way.
    - A send may complete as soon as the medium holds it (TCP socket buffers, shared-memory
      mailboxes) or only once the peer has received it (the in-memory transport's lockstep
      mode): a schedule must work either way, so it may not rely on sends being buffered.
    - An exchange that cannot finish by its deadline raises ``CommTimeoutError`` naming the
      peer it waited for; one whose peer aborted, closed or died raises ``PeerClosedError``
      (or the class the aborting rank relayed) naming that peer, carrying an abort's reason.
    - After an exchange failed, or after ``abort``, ``sever`` or ``close``, this transport's
      exchanges raise a ``CommError`` at once: a failed step may have left frames half sent.
    """

    rank: int
    world: int
    name: str = "abstract"

    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        """Send ``outs`` and receive ``ins`` concurrently; ``what`` names the op for errors."""
        raise NotImplementedError

    def abort(self, reason: str) -> None:
        """Make every current and future exchange fail promptly (idempotent), this rank's
        and its peers': they report ``reason`` (the first one given) and this rank."""
        raise NotImplementedError

    def close(self) -> None:
        """Release every resource (idempotent): sockets, descriptors, mappings, threads.
        Peers still waiting for this rank's frames get ``PeerClosedError`` naming it."""
        raise NotImplementedError

    def sever(self, reason: str) -> None:
        """Drop every connection abruptly, without telling peers why (fault injection:
        what a pulled cable or a crash looks like to them). Defaults to ``abort``."""
        self.abort(reason)
