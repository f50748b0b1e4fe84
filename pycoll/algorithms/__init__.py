"""Every algorithm, by collective and name: ``ALGORITHMS[collective][name]`` is a pure
schedule function (see ``schedule.py``), ``COSTS[collective][name]`` its
``cost(world, nbytes, params) -> seconds`` (see ``cost.py``; the tuner takes the cheapest);
``BUSY[collective][name]`` how many ranks its rounds keep at work; ``get`` looks a schedule
up with a helpful error. Within a collective the order is the
tuner's tie-break: of algorithms that cost the same, the first listed wins.

Signatures by collective (counts in elements):
  all_reduce, all_gather(rank, world, count)
  broadcast, reduce, gather, scatter(rank, world, count, root)
  reduce_scatter(rank, world, counts)
  all_to_all(rank, world, send_counts, recv_counts)
  barrier(rank, world)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from pycoll.algorithms import (
    binomial_broadcast,
    binomial_reduce,
    bruck_allgather,
    dissemination_barrier,
    halving_doubling_allreduce,
    linear_gather,
    linear_scatter,
    pairwise_alltoall,
    pairwise_reduce_scatter,
    recursive_doubling_allgather,
    recursive_doubling_allreduce,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
    scatter_allgather_broadcast,
    tree_allreduce,
)
from pycoll.algorithms.cost import CostFn, all_busy
from pycoll.algorithms.schedule import Schedule

ScheduleFn = Callable[..., Schedule]

MODULES: dict[str, dict[str, ModuleType]] = {
    "all_reduce": {
        "ring": ring_allreduce,
        "recursive_doubling": recursive_doubling_allreduce,
        "halving_doubling": halving_doubling_allreduce,
        "tree": tree_allreduce,
    },
    "broadcast": {
        "binomial": binomial_broadcast,
        "scatter_allgather": scatter_allgather_broadcast,
    },
    "reduce": {"binomial": binomial_reduce},
    "all_gather": {
        "ring": ring_allgather,
        "bruck": bruck_allgather,
        "recursive_doubling": recursive_doubling_allgather,  # Bruck's schedule off powers of two
    },
    "reduce_scatter": {
        "ring": ring_reduce_scatter,
        "pairwise": pairwise_reduce_scatter,
    },
    "all_to_all": {"pairwise": pairwise_alltoall},
    "gather": {"linear": linear_gather},
    "scatter": {"linear": linear_scatter},
    "barrier": {"dissemination": dissemination_barrier},
}

ALGORITHMS: dict[str, dict[str, ScheduleFn]] = {
    c: {name: m.schedule for name, m in algos.items()} for c, algos in MODULES.items()}
COSTS: dict[str, dict[str, CostFn]] = {
    c: {name: m.cost for name, m in algos.items()} for c, algos in MODULES.items()}
# ranks at work in an algorithm's rounds, ``busy(world)`` (cost.py: crowded rounds)
BUSY: dict[str, dict[str, Callable[[int], int]]] = {
    c: {name: getattr(m, "busy", all_busy) for name, m in algos.items()} for c, algos in MODULES.items()}


def get(collective: str, name: str) -> ScheduleFn:
    """The schedule function ``name`` of ``collective``; ValueError names the valid choices."""
    algos = ALGORITHMS.get(collective)
    if algos is None:
        valid = ", ".join(sorted(ALGORITHMS))
        raise ValueError(f"unknown collective {collective!r}; valid: {valid}")
    fn = algos.get(name)
    if fn is None:
        valid = ", ".join(sorted(algos))
        raise ValueError(f"unknown {collective} algorithm {name!r}; valid: {valid}")
    return fn
