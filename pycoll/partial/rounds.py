"""Round bookkeeping of the partial all-reduce (eager-SGD): pure, no I/O, no threads.

Everything that every rank must agree on is a function of the round number, the seed and
the metadata of earlier rounds, which every rank receives identically as part of each
round's all-reduce. So each rank computes it alone, with no extra messages: the majority
initiator of a round, the ranks a round must wait for (the staleness bound), and each
rank's consecutive-miss counter.

Indices. A rank's n-th deposit (``submit``) has index n (counted from the last flush); it
is paired with round n: the handle of deposit n resolves to round n's result, so every
rank applies every round's result exactly once and in the same order. Round k takes, from
each rank, every pending deposit with index <= k; the age of a deposit contributed in
round k is ``k - index`` (0: as in synchronous SGD).

Staleness bound (``max_staleness`` = K). Round k must include every rank's deposit k - K:
a rank whose last contributed index is below k - K is *required* and its progress thread
waits for that deposit before contributing. So no contribution is older than K rounds
and no rank is left out of more than K rounds in a row. K = 0 is synchronous SGD.

Metadata. Each rank fills its own slot of ``FIELDS`` in the round buffer (the others are
zero), so after the SUM all-reduce every rank holds every slot.
"""

from __future__ import annotations

from typing import NamedTuple

MODES = ("solo", "majority")
FIELDS = ("count", "oldest_age", "newest_age", "initiated", "flushing", "left")
NF = len(FIELDS)
_MASK = (1 << 64) - 1


def majority_initiator(seed: int, k: int, world: int) -> int:
    """The initiator of majority round k: splitmix64 of (seed, k), the same on every rank."""
    z = (seed * 0x9E3779B97F4A7C15 + (k + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % world


class RoundInfo(NamedTuple):
    """What one round did, identical on every rank.

    ``counts[r]``: deposits rank r contributed; ``ages[r]``: (newest, oldest) age in rounds
    of those deposits, None if it contributed nothing; ``misses[r]``: rounds in a row rank
    r has been left out, this one included; ``required``: the ranks this round waited for
    because of the staleness bound; ``flush``: this round completed a flush. (A NamedTuple:
    one is made every round, and a frozen dataclass costs three times as much.)
    """

    round: int
    mode: str
    initiators: tuple[int, ...]
    required: tuple[int, ...]
    counts: tuple[int, ...]
    ages: tuple[tuple[int, int] | None, ...]
    misses: tuple[int, ...]
    flush: bool = False

    @property
    def contributors(self) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.counts) if n)

    @property
    def count(self) -> int:
        """Number of deposits summed in this round's result."""
        return sum(self.counts)

    @property
    def max_age(self) -> int:
        return max((a[1] for a in self.ages if a is not None), default=0)


class Contribution(NamedTuple):
    """One rank's slot: the deposits it put into a round and what it still holds back
    (a NamedTuple: one is made every round, and a frozen dataclass costs several times more)."""

    count: int = 0
    oldest: int = 0        # index of its oldest deposit in the round (meaningful if count)
    newest: int = 0        # index of its newest deposit in the round
    initiated: bool = False
    flushing: bool = False
    left: int = 0          # deposits still pending after this round (indices > k)

    def row(self, k: int) -> list[int]:
        if self.count:
            ages = [k - self.oldest, k - self.newest]
        else:
            ages = [0, 0]
        return [self.count, *ages, int(self.initiated), int(self.flushing), self.left]


class Ledger:
    """The state every rank keeps identically: current round, last index contributed by
    each rank, consecutive misses; decides who may initiate and who is required."""

    def __init__(self, world: int, mode: str, max_staleness: int, seed: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"partial all-reduce mode must be one of {MODES}, got {mode!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        self.world, self.mode, self.max_staleness, self.seed = world, mode, max_staleness, seed
        self.k = 0
        self.base = 0                      # index of the first deposit since the last flush
        self.last = [-1] * world           # highest index each rank has contributed
        self.misses = [0] * world
        self._initiator: tuple[int, int] = (-1, 0)   # (round, its majority initiator)

    def initiator(self, k: int | None = None) -> int | None:
        """The rank allowed to start round k (majority), or None: any rank may (solo)."""
        if self.mode == "solo":
            return None
        k = self.k if k is None else k
        if self._initiator[0] != k:       # asked several times a round: computed once
            self._initiator = (k, majority_initiator(self.seed, k, self.world))
        return self._initiator[1]

    def may_initiate(self, rank: int) -> bool:
        who = self.initiator()
        return who is None or who == rank

    def required(self) -> tuple[int, ...]:
        """Ranks whose deposit ``k - max_staleness`` round k must include."""
        floor = self.k - self.max_staleness
        if min(self.last) >= floor:     # the common case, without a Python loop
            return ()
        return tuple(r for r in range(self.world) if self.last[r] < floor)

    def must_include(self, rank: int) -> int | None:
        """The deposit index this rank must contribute in the current round, if required."""
        floor = self.k - self.max_staleness
        return floor if self.last[rank] < floor else None

    def close_round(self, rows: list[list[int]]) -> RoundInfo:
        """Apply the all-reduced metadata (one row of ``FIELDS`` per rank); advance."""
        if len(rows) != self.world or any(len(r) != NF for r in rows):
            raise ValueError(f"round metadata must be {self.world} rows of {NF} fields")
        k, required = self.k, self.required()
        counts, ages, initiators = [], [], []
        for r, (count, oldest_age, newest_age, initiated, _flushing, _left) in enumerate(rows):
            counts.append(count)
            if count:
                ages.append((newest_age, oldest_age))
                if newest_age < 0 or k - oldest_age <= self.last[r]:
                    raise RuntimeError(f"partial all-reduce round {k}: rank {r} contributed deposits "
                                       f"{k - oldest_age}..{k - newest_age} but had already "
                                       f"contributed up to {self.last[r]} (metadata corrupt)")
                self.last[r] = k - newest_age
                self.misses[r] = 0
            else:
                ages.append(None)
                self.misses[r] += 1
            if initiated:
                initiators.append(r)
        flush = all(row[4] for row in rows) and not any(row[5] for row in rows)
        info = RoundInfo(k, self.mode, tuple(initiators), required, tuple(counts), tuple(ages),
                         tuple(self.misses), flush)
        self.k += 1
        if flush:  # every deposit is in: start afresh, deposit index == round index
            self.base = self.k
            self.last = [k] * self.world
            self.misses = [0] * self.world
        return info
