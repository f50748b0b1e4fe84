"""The rule table: (collective, bytes, world size, topology) -> algorithm name.

Rules are ordered (upper byte bound, algorithm) pairs, first match wins. They follow the
alpha-beta models in docs/algorithms.md: latency-optimal (log P steps) algorithms for small
messages, bandwidth-optimal ones (ring, halving-doubling) for large. ``PYCOLL_ALGO``
overrides them, either per collective (``all_reduce=ring,broadcast=binomial``) or for
every collective that has an algorithm of that name (``ring``); a group can be given its
own overrides too (``pycoll.set_algorithm``).
"""

from __future__ import annotations

import os

from pycoll import algorithms

INF = float("inf")
KiB, MiB = 1 << 10, 1 << 20

RULES: dict[str, list[tuple[float, str]]] = {
    "all_reduce": [(16 * KiB, "recursive_doubling"), (256 * KiB, "halving_doubling"), (INF, "ring")],
    "broadcast": [(512 * KiB, "binomial"), (INF, "scatter_allgather")],
    "reduce": [(INF, "binomial")],
    "all_gather": [(16 * KiB, "bruck"), (INF, "ring")],
    "reduce_scatter": [(INF, "ring")],
    "all_to_all": [(INF, "pairwise")],
    "gather": [(INF, "linear")],
    "scatter": [(INF, "linear")],
    "barrier": [(INF, "dissemination")],
}
# With two ranks every algorithm sends the same bytes; the simplest has the fewest steps.
SMALL_WORLD = {"broadcast": "binomial"}


def parse_overrides(text: str | None) -> dict[str, str]:
    """``"ring"`` or ``"all_reduce=ring,broadcast=binomial"`` -> {collective: algorithm}."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        if "=" in item:
            coll, name = (s.strip() for s in item.split("=", 1))
            algorithms.get(coll, name)  # validates, raises ValueError with the choices
            out[coll] = name
        else:
            matched = [c for c, table in algorithms.ALGORITHMS.items() if item in table]
            if not matched:
                raise ValueError(f"PYCOLL_ALGO: no collective has an algorithm named {item!r}")
            out.update({c: item for c in matched})
    return out


class Tuner:
    def __init__(self, world: int, overrides: dict[str, str] | None = None) -> None:
        self.world = world
        self.overrides = dict(parse_overrides(os.environ.get("PYCOLL_ALGO")))
        self.overrides.update(overrides or {})

    def choose(self, collective: str, nbytes: int, world: int | None = None) -> str:
        name = self.overrides.get(collective)
        if name is not None:
            return name
        if (world or self.world) <= 2 and collective in SMALL_WORLD:
            return SMALL_WORLD[collective]
        for bound, algo in RULES[collective]:
            if nbytes <= bound:
                return algo
        raise AssertionError("rule tables end with an unbounded rule")
