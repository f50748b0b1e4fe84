"""Every algorithm, by collective and name: ``ALGORITHMS[collective][name]`` is a pure
schedule function (see ``schedule.py``); ``get`` looks one up with a helpful error.

Signatures by collective (counts in elements):
  all_reduce, all_gather(rank, world, count)
  broadcast, reduce, gather, scatter(rank, world, count, root)
  reduce_scatter(rank, world, counts)
  all_to_all(rank, world, send_counts, recv_counts)
  barrier(rank, world)
"""

from __future__ import annotations

from typing import Callable

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
from pycoll.algorithms.schedule import Schedule

ScheduleFn = Callable[..., Schedule]

ALGORITHMS: dict[str, dict[str, ScheduleFn]] = {
    "all_reduce": {
        "ring": ring_allreduce.schedule,
        "recursive_doubling": recursive_doubling_allreduce.schedule,
        "halving_doubling": halving_doubling_allreduce.schedule,
        "tree": tree_allreduce.schedule,
    },
    "broadcast": {
        "binomial": binomial_broadcast.schedule,
        "scatter_allgather": scatter_allgather_broadcast.schedule,
    },
    "reduce": {"binomial": binomial_reduce.schedule},
    "all_gather": {
        "ring": ring_allgather.schedule,
        "bruck": bruck_allgather.schedule,
        "recursive_doubling": recursive_doubling_allgather.schedule,  # power-of-two worlds only
    },
    "reduce_scatter": {
        "ring": ring_reduce_scatter.schedule,
        "pairwise": pairwise_reduce_scatter.schedule,
    },
    "all_to_all": {"pairwise": pairwise_alltoall.schedule},
    "gather": {"linear": linear_gather.schedule},
    "scatter": {"linear": linear_scatter.schedule},
    "barrier": {"dissemination": dissemination_barrier.schedule},
}


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
