"""Exceptions that pycoll raises: part of the interface, so each names what went wrong where.

Every communication error carries the collective, its sequence number, this rank and the
peer involved, so a user reading one rank's log knows which rank to look at next.
"""

from __future__ import annotations


class PycollError(RuntimeError):
    """Base class of every error pycoll raises after validation (DistBackendError-like)."""


class CommError(PycollError):
    """A transfer failed; the process group is unusable afterwards (as Gloo's context)."""

    # Set when this error was relayed by a peer's ABORT frame: the rank where the failure
    # started and its own words, passed on unchanged if this rank relays it further.
    origin: int = -1
    root_cause: str | None = None

    def __init__(self, msg: str, *, op: str = "", seq: int = -1, rank: int = -1, peer: int = -1):
        super().__init__(msg)
        self.op, self.seq, self.rank, self.peer = op, seq, rank, peer


class CommTimeoutError(CommError, TimeoutError):
    """A blocking wait passed its deadline.

    ``timeout_s``, once known (the communicator sets it for the op that timed out), adds
    torch's usual wording to the message ("Timed out waiting 1000ms"), which tools written
    for gloo and NCCL search for.
    """

    timeout_s: float | None = None

    def __str__(self) -> str:
        text = super().__str__()
        if self.timeout_s is None or "; Timed out waiting " in text:
            return text   # (a timeout relayed from another rank has its own wording already)
        return f"{text}; Timed out waiting {round(self.timeout_s * 1000)}ms (the op's timeout)"


class PeerClosedError(CommError, ConnectionError):
    """A peer closed its connection or died (EOF, reset, dead pid)."""


class MismatchError(CommError):
    """Ranks disagree on the collective, its size, dtype, reduce op or root."""


class ProtocolError(CommError):
    """A peer sent bytes that are not a valid pycoll frame."""


class AuthenticationError(PycollError):
    """A connection could not prove it belongs to this process group."""


def root_cause(exc: BaseException) -> str:
    """The text that names where a failure started: a relayed error's original words, or
    the error itself (what a rank passes on when it aborts)."""
    cause = getattr(exc, "root_cause", None)
    return cause if cause else f"{type(exc).__name__}: {exc}"


def drop_locals(exc: BaseException) -> None:
    """Clear the local variables of the finished frames in ``exc``'s traceback (and in those
    of its causes). An error that a group keeps (its latched error, a failed Work's
    ``exception()``) would otherwise keep every local of the collective that raised it alive:
    views of the shared-memory arena among them, which keep its mapping from being released
    when the group is destroyed. The traceback's text (files, lines, names) stays."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
