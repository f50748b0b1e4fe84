"""The cost model every algorithm states its cost in, and the parameters it is priced with.

An algorithm's time is T = a*alpha + b*beta + c*gamma + d*delta, where, on the critical path
(the busiest rank where ranks differ):

- a = messages (communication rounds), alpha = seconds per message: the fixed cost of a step,
  which in pycoll is mostly Python (schedule walk, frame header, a thread's wake-up);
- b = bytes moved, beta = seconds per byte on a link;
- c = bytes reduced, gamma = seconds per byte of a reduction kernel;
- d = bytes copied locally, delta = seconds per byte of a local copy (memory bandwidth).

With more ranks on a host than cores (``Tuner(cores=...)``), a round in which more ranks are
busy than there are cores waits for a scheduler's wake-up and time slice: it costs
``alpha_crowded`` instead of alpha. How many ranks an algorithm keeps busy is its module's
``busy(world)`` (all of them but where a fold leaves ranks idle: recursive doubling and
halving-doubling off powers of two).

(a, b, c) are the ``Terms`` of docs/algorithms.md's table, one ``terms(world, n)`` per algorithm
module, checked against the schedules themselves by tests/clients/test_model_check.py. d, the local
copies (``copied(world, n)``), is the textbook model's blind spot that this package adds: it
is what makes Bruck's rotation (a copy of the whole output) lose to ring for large all-gathers,
and recursive doubling's final copy count against it for large all-reduces.

n is the docs' n: one rank's block for all_gather, gather and scatter, the whole buffer
otherwise. ``cost_of`` turns a module's functions into its ``cost(world, nbytes, params)``,
where nbytes is what the communicator passes the tuner (the whole output for those three).
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass

# Coefficients of alpha, beta and gamma: rounds, bytes moved and bytes reduced (critical path).
Terms = namedtuple("Terms", "alpha beta gamma")
ZERO = Terms(0, 0, 0)


KEYS = ("alpha", "beta", "gamma", "delta", "alpha_crowded")


@dataclass(frozen=True)
class Params:
    """Seconds per message (alpha) and per byte moved (beta), reduced (gamma), copied (delta)."""

    alpha: float
    beta: float
    gamma: float
    delta: float = 0.0
    # alpha of a round in which more ranks of one host are busy than it has cores (``busy``)
    alpha_crowded: float = 0.0

    def __post_init__(self) -> None:
        for key in KEYS:
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"cost parameter {key}={v!r}: must be a finite number >= 0")

    def seconds(self, terms: Terms, copied: float = 0.0) -> float:
        return (terms.alpha * self.alpha + terms.beta * self.beta + terms.gamma * self.gamma
                + copied * self.delta)


CostFn = Callable[[int, int, Params], float]


def cost_of(terms: Callable[[int, float], Terms], copied: Callable[[int, float], float],
            block: bool = False) -> CostFn:
    """An algorithm's ``cost(world, nbytes, params) -> seconds`` from its ``terms`` and
    ``copied`` (both in the docs' n; ``block``: n is nbytes / world, one rank's block)."""

    def cost(world: int, nbytes: int, params: Params) -> float:
        n = nbytes / world if block else nbytes
        return params.seconds(terms(world, n), copied(world, n))

    cost.__doc__ = f"Seconds for {terms.__module__}: terms() and copied() priced with params."
    return cost


def clog2(p: int) -> int:
    """ceil(log2 p): rounds of a binomial tree or of dissemination over p ranks."""
    return (p - 1).bit_length()


def fold(world: int) -> tuple[int, int, int]:
    """(p, 1 if the MPICH fold runs else 0, log2 p) of a power-of-two algorithm on ``world``."""
    p = 1 << (world.bit_length() - 1)
    return p, int(p != world), clog2(p)


def all_busy(world: int) -> int:
    """``busy`` of the algorithms that keep every rank at work in their rounds."""
    return world


def fold_busy(world: int) -> int:
    """``busy`` of the algorithms that fold to a power of two: the folded ranks sit out."""
    return fold(world)[0]


def no_copies(world: int, n: float) -> float:
    """``copied`` of the algorithms that copy nothing locally."""
    return 0.0
