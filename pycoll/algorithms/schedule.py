"""The vocabulary every algorithm is written in: a schedule is a list of steps of actions.

An algorithm is a pure function ``(rank, world, counts...) -> Schedule``: no I/O, no
tensors, only which element ranges move between which named buffers. The executor runs
it, the unit tests run it on the in-memory transport, and ``pycoll draw`` draws it.

Buffers are named: ``"in"`` (the caller's input, never written), ``"out"`` (the caller's
output) and any temporaries listed in ``Schedule.temps`` (name -> element count). Ranges
are in elements of the collective's dtype.

Step semantics: a step holds either local actions (``Copy``, ``Reduce``; run in order) or
communication actions (``Send``, ``Recv``, ``RecvReduce``; run concurrently, the step ends
when all are done). Messages between two ranks are matched in order, so both sides of a
pair list their transfers to each other in the same order within a step. A communication
step never writes a range that it also sends (checked by ``validate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True, slots=True)
class Send:
    peer: int
    buf: str
    start: int
    count: int


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive into ``buf[start:start+count]``, overwriting it."""

    peer: int
    buf: str
    start: int
    count: int


@dataclass(frozen=True, slots=True)
class RecvReduce:
    """Receive and reduce into ``buf[start:start+count]`` (``dst = dst op incoming``)."""

    peer: int
    buf: str
    start: int
    count: int


@dataclass(frozen=True, slots=True)
class Copy:
    src: str
    src_start: int
    dst: str
    dst_start: int
    count: int


@dataclass(frozen=True, slots=True)
class Reduce:
    """Local ``dst[...] = dst[...] op src[...]``."""

    src: str
    src_start: int
    dst: str
    dst_start: int
    count: int


Action = Union[Send, Recv, RecvReduce, Copy, Reduce]
COMM = (Send, Recv, RecvReduce)
LOCAL = (Copy, Reduce)


@dataclass
class Schedule:
    name: str
    rank: int
    world: int
    steps: list[tuple[Action, ...]] = field(default_factory=list)
    temps: dict[str, int] = field(default_factory=dict)

    def add(self, *actions: Action) -> None:
        """Append one step (empty steps are dropped: a rank idle in a round has none)."""
        if actions:
            self.steps.append(tuple(actions))

    def bytes_sent(self, itemsize: int) -> int:
        return sum(a.count * itemsize for step in self.steps for a in step if isinstance(a, Send))


def chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous (start, size) ranges, sizes within one."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, size))
        start += size
    return out


def pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def validate(s: Schedule) -> None:
    """Check a schedule's shape: steps are all-local or all-comm, peers valid, no write/send overlap."""
    for i, step in enumerate(s.steps):
        kinds = {isinstance(a, COMM) for a in step}
        if len(kinds) != 1:
            raise AssertionError(f"{s.name} step {i} mixes local and communication actions")
        if not isinstance(step[0], COMM):
            continue
        sends = [(a.buf, a.start, a.start + a.count) for a in step if isinstance(a, Send) and a.count]
        for a in step:
            if not 0 <= a.peer < s.world or a.peer == s.rank:
                raise AssertionError(f"{s.name} step {i}: bad peer {a.peer} on rank {s.rank}")
            if isinstance(a, (Recv, RecvReduce)) and a.count:
                for buf, lo, hi in sends:
                    if buf == a.buf and lo < a.start + a.count and a.start < hi:
                        raise AssertionError(f"{s.name} step {i}: writes a range it also sends")
            if a.buf == "in" and isinstance(a, (Recv, RecvReduce)):
                raise AssertionError(f"{s.name} step {i}: writes the input buffer")
