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


Action = Send | Recv | RecvReduce | Copy | Reduce
COMM = (Send, Recv, RecvReduce)


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
        """Payload bytes this rank sends (tests/clients/test_model_check.py checks the beta terms on it)."""
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


def displacements(counts: list[int]) -> list[int]:
    """Prefix sums: where each rank's block starts in a buffer laid out in rank blocks."""
    out, start = [], 0
    for c in counts:
        out.append(start)
        start += c
    return out


# Binomial trees over relative ranks v = (rank - root) % world: v's parent is v minus its
# lowest set bit; its children are v + m for each power of two m below that bit (and < world).

def binomial_parent(v: int) -> int | None:
    return None if v == 0 else v - (v & -v)


def binomial_children(v: int, world: int) -> list[int]:
    """Children of ``v``, nearest first (the order a reduce receives them in)."""
    low = (v & -v) if v else 1 << max(world - 1, 0).bit_length()
    out, m = [], 1
    while m < low and v + m < world:
        out.append(v + m)
        m <<= 1
    return out


def subtree(v: int, world: int) -> tuple[int, int]:
    """The relative ranks [v, end) of the binomial subtree rooted at ``v``."""
    low = (v & -v) if v else 1 << max(world - 1, 0).bit_length()
    return v, min(v + low, world)


# The MPICH fold for power-of-two algorithms on any world: with p = pow2_floor(world) and
# rem = world - p, each even rank below 2*rem hands its data to the odd rank above it and
# sits out; the p remaining ranks are renumbered 0..p-1.

def fold_rank(rank: int, world: int) -> int | None:
    """This rank's number among the p active ranks, or None if it sits out."""
    rem = world - pow2_floor(world)
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else None
    return rank - rem


def fold_in(s: Schedule, rank: int, world: int, count: int) -> int | None:
    """The fold's first step on buffer "out"; returns this rank's new number (None: sits out)."""
    new = fold_rank(rank, world)
    if rank < 2 * (world - pow2_floor(world)):
        s.add(Send(rank + 1, "out", 0, count) if new is None else RecvReduce(rank - 1, "out", 0, count))
    return new


def fold_out(s: Schedule, rank: int, world: int, count: int, new: int | None) -> None:
    """The fold's last step: the ranks that sat out get the result from their partner."""
    if rank < 2 * (world - pow2_floor(world)):
        s.add(Recv(rank + 1, "out", 0, count) if new is None else Send(rank - 1, "out", 0, count))


def unfold_rank(new: int, world: int) -> int:
    rem = world - pow2_floor(world)
    return 2 * new + 1 if new < rem else new + rem


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
