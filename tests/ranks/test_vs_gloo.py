"""pycoll against gloo, in the same processes, on the same seeded inputs.

Every rank initialises pycoll as its default group and opens a gloo group over the same
ranks; each check runs one collective on pycoll and on gloo with identical inputs (regenerated
from a seed, so the two calls never share memory) and compares the results: exactly for
integers and bool (and for all data movement), for floating point within the error bound
that a different summation order implies. Where gloo does not support something (AVG on
integers, PREMUL_SUM, int16, uneven reduce_scatter...) the result is compared with a
whole-world reference computed in the rank from all ranks' seeded inputs instead; pycoll is
compared with that reference in every case anyway.

A rank function covers a whole area (all collectives x dtypes x ops x sizes x roots) and
returns a list of mismatches, so that one failing test shows every mismatch at once, each
naming collective, dtype, op, size, root, world, rank and the max abs diff.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pycoll.testing.ranks import run_ranks
from tests.support.vs_gloo import _area, _assert_clean

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


# -- whole-world reference -------------------------------------------------------------------


# -- comparison ------------------------------------------------------------------------------


# -- the rank functions --------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("area", ["reductions", "movement"])
@pytest.mark.parametrize("world,transport", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"),
                                             (2, "tcp"), (4, "tcp")])
def test_every_collective_vs_gloo(world, transport, area):
    """Every collective x dtype x op x size (x root) on pycoll == gloo (== reference), on the
    default path (auto: shared memory here) and on TCP (world 3 on TCP: the forced runs below)."""
    _assert_clean(run_ranks(_area, world, area, True, backend="pycoll", timeout=140,
                            env={"PYCOLL_TRANSPORT": transport}))


# Every algorithm of every collective at least once, at world sizes 3 and 4, forced with
# PYCOLL_ALGO; small segments in half the runs so that multi-segment frames run too.
ALGOS = {
    "all_reduce": ["ring", "recursive_doubling", "halving_doubling", "tree"],
    "all_gather": ["ring", "bruck", "recursive_doubling"],
    "broadcast": ["binomial", "scatter_allgather"],
    "reduce_scatter": ["ring", "pairwise"],
}


def _forced(i: int, world: int) -> str:
    parts = []
    for coll, names in ALGOS.items():
        usable = [a for a in names if not (a == "recursive_doubling" and coll == "all_gather" and world & (world - 1))]
        parts.append(f"{coll}={usable[i % len(usable)]}")
    return ",".join(parts)


def _algo_run(rank: int, world: int, expect: str) -> dict:
    from pycoll.core.tuner import parse_overrides

    pg = dist.distributed_c10d._get_default_group()
    comm = getattr(pg, "communicator", None)
    fails = []
    if comm is not None and comm.tuner.overrides != parse_overrides(expect):
        fails.append(f"rank {rank}: PYCOLL_ALGO not applied: {comm.tuner.overrides}")
    r1 = _area(rank, world, "reductions", False)
    r2 = _area(rank, world, "movement", False)
    return {"fails": fails + r1["fails"] + r2["fails"], "checks": r1["checks"] + r2["checks"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("i", range(4))
@pytest.mark.parametrize("world", [3, 4])
def test_forced_algorithms_vs_gloo(world, i):
    algo = _forced(i, world)
    env = {"PYCOLL_ALGO": algo, "PYCOLL_TRANSPORT": "tcp"}   # schedules run on the TCP path
    if i % 2:
        env["PYCOLL_SEGMENT_BYTES"] = "4096"
    _assert_clean(run_ranks(_algo_run, world, algo, backend="pycoll", timeout=110, env=env))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,hosts", [(3, "h0,h0,h1"), (4, "h0,h0,h1,h1")])
def test_hierarchical_vs_gloo(world, hosts):
    """Two emulated hosts (PYCOLL_HOST_ID): shared memory within each, TCP between leaders."""
    env = {"PYCOLL_TRANSPORT": "hierarchical", "PYCOLL_HOST_ID": hosts}
    _assert_clean(run_ranks(_hier_run, world, backend="pycoll", timeout=140, env=env))


def _hier_run(rank: int, world: int) -> dict:
    comm = dist.distributed_c10d._get_default_group().communicator
    fails = [] if comm.mode == "hierarchical" and len(comm.leaders) == 2 else [
        f"rank {rank}: mode {comm.mode}, leaders {comm.leaders}"]
    r1 = _area(rank, world, "reductions", False)
    r2 = _area(rank, world, "movement", False)
    return {"fails": fails + r1["fails"] + r2["fails"], "checks": r1["checks"] + r2["checks"]}
