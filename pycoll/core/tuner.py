"""The tuner: per (collective, bytes, world size), the algorithm the cost model says is cheapest.

Every algorithm states its cost, ``cost(world, nbytes, params)`` (``pycoll.algorithms.COSTS``,
the alpha-beta-gamma(-delta) model of docs/algorithms.md). ``choose`` returns the argmin under
this group's parameters: ``PYCOLL_COST`` (``alpha=38us,beta=0.44ns,gamma=0.07ns,delta=0.32ns``;
any key left out keeps its default) or ``DEFAULT_PARAMS``, fitted on this project's machine
for the TCP loopback path (docs/performance.md, "The tuner's parameters"). Of algorithms that
cost the same the first registered wins, so the choice is the same on every rank. The world
is the group's, or, on the hierarchical path, the number of host leaders that run the schedule
over TCP (``choose``'s ``world``): each gets its own table.

The choice is computed once per (collective, world) as a table of byte bounds (each
algorithm's cost is linear in the bytes, so the cheapest one changes at a few crossover points,
found to the byte); ``choose`` then costs a dict lookup and a bisect, as the old rule table's
scan did. With ``PYCOLL_DEBUG`` set the table is logged (logger "pycoll", INFO) when first
built: every candidate's cost at a few sizes and the crossovers, as NCCL logs its tuning.

``PYCOLL_ALGO`` forces algorithms, per collective (``all_reduce=ring,broadcast=binomial``) or
for every collective that has an algorithm of that name (``ring``); a group can be given its
own (``pycoll.set_algorithm``, which writes ``Tuner.overrides``). Forcing wins over the model.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from dataclasses import replace

from pycoll import algorithms, settings
from pycoll.algorithms.cost import KEYS, Params

log = logging.getLogger("pycoll")

ENV_COST, ENV_ALGO, ENV_DEBUG = "PYCOLL_COST", "PYCOLL_ALGO", "PYCOLL_DEBUG"

# Fitted to all-reduce times of every algorithm at world 2 on the TCP loopback path of this
# project's 2-vCPU machine (tools/algo_sweep.py --fit; how, when and the run's figures:
# docs/performance.md, "The tuner's parameters"). Most of alpha is Python per step, so it
# holds about as well for any host running pycoll; across a real network set PYCOLL_COST.
DEFAULT_PARAMS = Params(alpha=38e-6, beta=0.44e-9, gamma=0.070e-9, delta=0.32e-9,
                        alpha_crowded=150e-6)
# alpha_crowded prices a round in which more ranks of a host are busy than it has cores
# (forced TCP with several ranks per core): a wake-up and a time slice, not Python. Fitted
# to the interleaved world 3 and 4 sweeps on 2 vCPUs (docs/performance.md, "Crowded hosts").

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
# Crossovers are searched up to 1 TiB; the last algorithm of a table holds beyond.
_LIMIT = 1 << 40
# Costs this close count as equal (float rounding must not break the registry order tie).
_TIE = 1e-9


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
                raise ValueError(f"{ENV_ALGO}: no collective has an algorithm named {item!r}")
            out.update({c: item for c in matched})
    return out


def parse_cost(text: str | None, base: Params = DEFAULT_PARAMS) -> Params:
    """``"alpha=30e-6,beta=0.5ns,gamma=0.13ns,delta=0.1ns"`` -> Params; keys left out keep
    ``base``'s. Values are seconds (per byte for beta, gamma, delta), optionally with a unit
    s, ms, us or ns. ValueError names the variable, the item and the valid form."""
    values = {k: getattr(base, k) for k in KEYS}
    form = (f"{ENV_COST}=alpha=38us,beta=0.44ns,gamma=0.07ns,delta=0.32ns,alpha_crowded=150us "
            f"(seconds, or s/ms/us/ns)")
    seen: set[str] = set()
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        key, eq, raw = (s.strip() for s in item.partition("="))
        key = key.lower()
        if not eq or key not in values:
            raise ValueError(f"{ENV_COST}: {item!r} is not key=value with a key of "
                             f"{', '.join(values)}; e.g. {form}")
        if key in seen:
            raise ValueError(f"{ENV_COST}: {key} given twice; e.g. {form}")
        seen.add(key)
        unit = next((u for u in ("ms", "us", "ns", "s") if raw.lower().endswith(u)), "")
        try:
            v = float(raw[:len(raw) - len(unit)] if unit else raw) * _UNITS.get(unit, 1.0)
        except ValueError:
            raise ValueError(f"{ENV_COST}: {key}={raw!r} is not a number; e.g. {form}") from None
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{ENV_COST}: {key}={raw!r} must be finite and >= 0; e.g. {form}")
        values[key] = v
    return Params(**values)


class Tuner:
    """``cores``: set when every rank of the group runs the TCP rounds on a host with fewer
    cores than ranks; then a round of an algorithm that keeps more ranks busy than that
    (``algorithms.BUSY``) costs ``alpha_crowded``."""

    def __init__(self, world: int, overrides: dict[str, str] | None = None,
                 params: Params | None = None, cores: int | None = None) -> None:
        self.world, self.cores = world, cores
        self.overrides = dict(parse_overrides(settings.get(ENV_ALGO)))
        self.overrides.update(overrides or {})
        self.params = params if params is not None else parse_cost(settings.get(ENV_COST))
        self.source = ("given" if params is not None else
                       ENV_COST if settings.get(ENV_COST) else "defaults")
        self.debug = bool(settings.get(ENV_DEBUG))
        # (collective, world) -> (upper byte bounds, algorithms): algorithms[i] for
        # nbytes <= bounds[i], the last one beyond.
        self._tables: dict[tuple[str, int], tuple[list[int], list[str]]] = {}

    def choose(self, collective: str, nbytes: int, world: int | None = None) -> str:
        name = self.overrides.get(collective)
        if name is not None:
            return name
        key = (collective, world or self.world)
        table = self._tables.get(key)   # table()'s lookup, inline: this runs on every op
        if table is None:
            table = self._tables[key] = self._build(*key)
        bounds, names = table
        return names[bisect_left(bounds, nbytes)]

    def table(self, collective: str, world: int) -> tuple[list[int], list[str]]:
        """The (bounds, algorithms) that ``choose`` bisects, built if needed."""
        key = (collective, world)
        if key not in self._tables:
            self._tables[key] = self._build(collective, world)
        return self._tables[key]

    def _build(self, collective: str, world: int) -> tuple[list[int], list[str]]:
        costs = self.costs(collective, world)
        bounds, names = crossovers(costs, world, self.params)
        if self.debug and log.isEnabledFor(logging.INFO):
            log.info("%s", format_table(collective, world, self.params, self.source, bounds, names,
                                        costs, self.cores))
        return bounds, names

    def costs(self, collective: str, world: int) -> dict:
        """Each algorithm's ``cost(world, nbytes, params)`` as this group prices it: with
        ``alpha_crowded`` for an algorithm that keeps more ranks busy than ``cores``."""
        costs = algorithms.COSTS.get(collective)
        if costs is None:
            raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(algorithms.COSTS)}")
        if self.cores is None:
            return costs
        busy = algorithms.BUSY[collective]
        crowded = replace(self.params, alpha=self.params.alpha_crowded)
        return {name: (_priced(fn, crowded) if busy[name](world) > self.cores else fn)
                for name, fn in costs.items()}


def _priced(fn, params: Params):
    """``fn`` priced with ``params`` whatever it is asked with."""
    return lambda world, nbytes, _params: fn(world, nbytes, params)


def cheapest(costs: dict, world: int, nbytes: int, params: Params) -> str:
    """The argmin of ``costs`` at ``nbytes``; on a tie (within _TIE) the first listed."""
    best, best_t = "", math.inf
    for name, fn in costs.items():
        t = fn(world, nbytes, params)
        if t < best_t - _TIE * abs(best_t) or not best:
            best, best_t = name, t
    return best


def crossovers(costs: dict, world: int, params: Params) -> tuple[list[int], list[str]]:
    """Upper byte bounds and algorithms: ``names[i]`` is the cheapest for nbytes in
    (bounds[i-1], bounds[i]], the last beyond. Scans powers of two up to 1 TiB, then
    bisects each change to the byte (costs are linear in nbytes: each algorithm holds one
    interval, so a power-of-two scan that sees a change brackets it)."""
    # From 1 byte: at 0 bytes algorithms with the same rounds tie, and a zero-byte table
    # entry would only print as a crossover at 0 B. Zero-byte ops take names[0].
    names = [cheapest(costs, world, 1, params)]
    bounds: list[int] = []
    lo, hi = 1, 2
    while hi <= _LIMIT:
        if cheapest(costs, world, hi, params) != names[-1]:
            a, b = lo, hi  # names[-1] at a, another at b: find the first byte where it changes
            while b - a > 1:
                mid = (a + b) // 2
                if cheapest(costs, world, mid, params) == names[-1]:
                    a = mid
                else:
                    b = mid
            bounds.append(a)
            names.append(cheapest(costs, world, b, params))
            lo = b
            continue  # the same power of two again: a second change may lie before it
        lo, hi = hi, hi * 2
    return bounds, names


_SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


def format_table(collective: str, world: int, params: Params, source: str,
                 bounds: list[int], names: list[str], costs: dict | None = None,
                 cores: int | None = None) -> str:
    """What the tuner chose from: the parameters, the crossovers, and every candidate's
    cost (us) at a few sizes and at each crossover (* marks the choice)."""
    costs = costs or algorithms.COSTS[collective]
    p = params
    head = (f"tuner: {collective} world {world}, cost parameters ({source}): alpha "
            f"{p.alpha * 1e6:.4g} us, beta {p.beta * 1e9:.4g} ns/B, gamma {p.gamma * 1e9:.4g} "
            f"ns/B, delta {p.delta * 1e9:.4g} ns/B")
    if cores is not None:
        head += (f"; {world} ranks on {cores} cores: a round with more ranks busy costs "
                 f"alpha_crowded {p.alpha_crowded * 1e6:.4g} us")
    choice = names[0] + "".join(f" <= {_size(b)} < {n}" for b, n in zip(bounds, names[1:]))
    sizes = sorted(set(_SIZES) | set(bounds) | {b + 1 for b in bounds})
    width = max(12, *(len(n) + 2 for n in costs))
    lines = [head, f"  choice: {choice}",
             f"  {'bytes':>12}" + "".join(f"{n:>{width}}" for n in costs) + "   (us)"]
    for n in sizes:
        pick = names[bisect_left(bounds, n)]
        cells = "".join(f"{fn(world, n, p) * 1e6:>{width - 1}.1f}{'*' if a == pick else ' '}"
                        for a, fn in costs.items())
        lines.append(f"  {n:>12}{cells}")
    return "\n".join(lines)
