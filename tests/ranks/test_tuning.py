"""The tuner: cost functions against the schedules, the argmin and its crossovers, PYCOLL_COST
and PYCOLL_ALGO parsing, the PYCOLL_DEBUG table, transport choice and per-group overrides."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch
import torch.distributed as dist

import pycoll
from pycoll import algorithms
from pycoll.algorithms.cost import ZERO, Params, Terms, clog2
from pycoll.algorithms.schedule import Copy, Recv, RecvReduce, Send
from pycoll.core import tuner as tuner_mod
from pycoll.core.setup import choose_mode
from pycoll.core.tuner import (
    DEFAULT_PARAMS,
    Tuner,
    crossovers,
    parse_cost,
    parse_overrides,
)
from pycoll.testing.ranks import run_ranks

ITEM = 4  # float32
BLOCK = {"all_gather", "gather", "scatter"}  # n is one rank's block; nbytes the whole output
CASES = [(c, a) for c, algos in algorithms.MODULES.items() for a in algos]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("PYCOLL_ALGO", "PYCOLL_COST", "PYCOLL_DEBUG"):
        monkeypatch.delenv(var, raising=False)


def schedules(coll: str, algo: str, world: int, count: int) -> list:
    """Every rank's schedule; ``count`` elements in the docs' n (a block for BLOCK)."""
    fn = algorithms.get(coll, algo)
    if coll in ("broadcast", "reduce", "gather", "scatter"):
        return [fn(r, world, count, 0) for r in range(world)]
    if coll == "reduce_scatter":
        return [fn(r, world, [count // world] * world) for r in range(world)]
    if coll == "all_to_all":
        return [fn(r, world, [count // world] * world, [count // world] * world) for r in range(world)]
    if coll == "barrier":
        return [fn(r, world) for r in range(world)]
    return [fn(r, world, count) for r in range(world)]


# -- cost functions ------------------------------------------------------------------------

def test_every_algorithm_has_a_cost():
    assert set(algorithms.COSTS) == set(algorithms.ALGORITHMS)
    for coll, algos in algorithms.ALGORITHMS.items():
        assert list(algorithms.COSTS[coll]) == list(algos), coll


@pytest.mark.parametrize("coll,algo", CASES)
@pytest.mark.parametrize("world", range(1, 10))
def test_copied_is_the_busiest_ranks_local_copies(coll, algo, world):
    """``copied`` = the most bytes one rank's schedule copies locally (Copy actions)."""
    count = 2520 if coll != "barrier" else 0  # divisible by every world: even blocks
    module = algorithms.MODULES[coll][algo]
    most = max(sum(a.count * ITEM for step in s.steps for a in step if isinstance(a, Copy))
               for s in schedules(coll, algo, world, count))
    assert module.copied(world, count * ITEM) == pytest.approx(most)


@pytest.mark.parametrize("coll", ["gather", "scatter"])
@pytest.mark.parametrize("world", range(1, 10))
def test_linear_terms_are_the_roots_link(coll, world):
    """alpha + n(P-1) beta at the root: one step, and every other rank's block on its link."""
    count, n = 360, 360 * ITEM
    root = schedules(coll, "linear", world, count)[0]
    moved = sum(a.count * ITEM for step in root.steps for a in step
                if isinstance(a, (Send, Recv, RecvReduce)))
    rounds = sum(1 for step in root.steps if isinstance(step[0], (Send, Recv)))
    assert algorithms.MODULES[coll]["linear"].terms(world, n) == Terms(rounds, moved, 0)


@pytest.mark.parametrize("world", range(1, 10))
def test_binomial_reduce_terms_are_the_roots_rounds(world):
    count, n = 360, 360 * ITEM
    root = schedules("reduce", "binomial", world, count)[0]
    rounds = sum(1 for step in root.steps if isinstance(step[0], RecvReduce))
    assert rounds == clog2(world)
    assert algorithms.MODULES["reduce"]["binomial"].terms(world, n) == Terms(rounds, rounds * n, rounds * n)


def test_cost_prices_terms_and_copies():
    p = Params(alpha=1e-4, beta=1e-9, gamma=2e-10, delta=3e-10)
    n = 1 << 20
    # ring all-reduce, P = 4: 6 alpha + 1.5n beta + 0.75n gamma, nothing copied
    assert algorithms.COSTS["all_reduce"]["ring"](4, n, p) == pytest.approx(6e-4 + 1.5 * n * 1e-9 + 0.75 * n * 2e-10)
    # recursive doubling, P = 2: alpha + n (beta + gamma + delta): its last copy counts
    assert algorithms.COSTS["all_reduce"]["recursive_doubling"](2, n, p) == pytest.approx(1e-4 + n * 1.5e-9)
    # all_gather's nbytes is the whole output: n = nbytes / P; Bruck copies (P+1) n
    bruck = algorithms.MODULES["all_gather"]["bruck"]
    assert algorithms.COSTS["all_gather"]["bruck"](4, 4 * n, p) == pytest.approx(
        p.seconds(bruck.terms(4, n), 5 * n))
    assert algorithms.MODULES["all_reduce"]["ring"].terms(1, n) == ZERO


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_params_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match="alpha"):
        Params(alpha=bad, beta=0.0, gamma=0.0)


# -- the choice ----------------------------------------------------------------------------

def _slope(coll: str, algo: str, world: int, p: Params) -> float:
    """Seconds per byte of nbytes (the cost function is linear: 1 TiB minus 0 B, per byte)."""
    fn, big = algorithms.COSTS[coll][algo], 1 << 40
    return (fn(world, big, p) - fn(world, 0, p)) / big


@pytest.mark.parametrize("coll", [c for c, a in algorithms.MODULES.items() if len(a) > 1])
@pytest.mark.parametrize("world", range(2, 10))
def test_tiny_messages_take_the_fewest_rounds_large_ones_the_fewest_bytes(coll, world):
    t, p = Tuner(world), DEFAULT_PARAMS
    block = world if coll in BLOCK else 1
    rounds = {a: m.terms(world, 0).alpha for a, m in algorithms.MODULES[coll].items()}
    small = t.choose(coll, 1 * block, world)
    assert rounds[small] == min(rounds.values()), (small, rounds)
    slopes = {a: _slope(coll, a, world, p) for a in rounds}
    large = t.choose(coll, 1 << 40, world)
    assert slopes[large] == pytest.approx(min(slopes.values())), (large, slopes)


def test_all_reduce_switches_from_latency_to_bandwidth_optimal():
    for world, big in ((2, "ring"), (3, "ring"), (4, "halving_doubling"), (8, "halving_doubling")):
        t = Tuner(world)
        assert t.choose("all_reduce", 8) == "recursive_doubling", world
        assert t.choose("all_reduce", 64 << 20) == big, world
    assert Tuner(2).choose("broadcast", 64 << 20) == "binomial"  # P = 2: one message either way
    assert Tuner(4).choose("broadcast", 8) == "binomial"
    assert Tuner(4).choose("broadcast", 64 << 20) == "scatter_allgather"


@pytest.mark.parametrize("coll", list(algorithms.MODULES))
@pytest.mark.parametrize("world", [2, 3, 4, 5, 7, 8, 16])
def test_table_is_the_argmin_everywhere(coll, world):
    """The bisected table gives what a brute-force argmin gives, on both sides of every
    crossover and at random sizes; ties go to the first registered algorithm."""
    t, p, costs = Tuner(world), DEFAULT_PARAMS, algorithms.COSTS[coll]
    bounds, names = t.table(coll, world)
    assert len(names) == len(bounds) + 1 and bounds == sorted(bounds)
    assert all(a != b for a, b in itertools.pairwise(names))  # every bound is a change
    rng = random.Random(world)
    sizes = [1, 8, 1 << 20, 1 << 30] + [rng.randrange(1, 1 << 34) for _ in range(200)]
    sizes += [b for b in bounds] + [b + 1 for b in bounds]
    for n in sizes:
        got = t.choose(coll, n, world)
        cost = {a: fn(world, n, p) for a, fn in costs.items()}
        best = min(cost.values())
        assert cost[got] <= best * (1 + 1e-9), (n, got, cost)
        first = next(a for a, c in cost.items() if c <= best * (1 + 1e-9))
        assert got == first, (n, got, first)


def test_crossover_is_exact_to_the_byte():
    p = Params(alpha=50e-6, beta=0.5e-9, gamma=0.1e-9, delta=0.21e-9)
    bounds, names = crossovers(algorithms.COSTS["all_reduce"], 2, p)
    # P = 2: recursive doubling costs alpha + n(beta + gamma + delta), ring 2 alpha + n(beta +
    # gamma/2): equal at n = alpha / (gamma/2 + delta) = 192307.7 bytes
    assert names == ["recursive_doubling", "ring"]
    assert bounds == [192307]


def test_choose_builds_each_table_once(monkeypatch):
    calls = []
    real = tuner_mod.crossovers
    monkeypatch.setattr(tuner_mod, "crossovers", lambda *a: calls.append(a) or real(*a))
    t = Tuner(4)
    for n in range(0, 1 << 24, 4099):
        t.choose("all_reduce", n)
        t.choose("all_reduce", n, 2)
    assert len(calls) == 2


# -- PYCOLL_COST ---------------------------------------------------------------------------

def test_parse_cost_units_and_defaults():
    p = parse_cost("alpha=30us, beta=0.5ns ,gamma=1e-10,delta=2e-10s")
    assert (p.alpha, p.beta, p.gamma, p.delta) == pytest.approx((30e-6, 0.5e-9, 1e-10, 2e-10))
    assert parse_cost("ALPHA=1ms").alpha == pytest.approx(1e-3)
    q = parse_cost("beta=1ns")
    assert (q.alpha, q.gamma, q.delta) == (DEFAULT_PARAMS.alpha, DEFAULT_PARAMS.gamma, DEFAULT_PARAMS.delta)
    assert parse_cost("") == parse_cost(None) == DEFAULT_PARAMS


@pytest.mark.parametrize("text,what", [
    ("alpha", "not key=value"), ("epsilon=1", "not key=value"), ("alpha=fast", "not a number"),
    ("alpha=-1us", ">= 0"), ("beta=inf", "finite"), ("alpha=1us,alpha=2us", "twice"),
    ("beta=1 GB/s", "not a number"),
])
def test_bad_pycoll_cost_raises_a_clear_error(text, what, monkeypatch):
    with pytest.raises(ValueError, match=what) as err:
        parse_cost(text)
    assert "PYCOLL_COST" in str(err.value) and "alpha=" in str(err.value)  # names the variable, shows the form
    monkeypatch.setenv("PYCOLL_COST", text)
    with pytest.raises(ValueError, match="PYCOLL_COST"):
        Tuner(2)  # at group creation, not at the first collective


def test_pycoll_cost_moves_the_choice(monkeypatch):
    assert Tuner(4).choose("all_reduce", 64 << 20) == "halving_doubling"
    monkeypatch.setenv("PYCOLL_COST", "alpha=1000s")  # latency is everything
    t = Tuner(4)
    assert t.source == "PYCOLL_COST" and t.params.alpha == 1000
    assert t.choose("all_reduce", 64 << 20) == "recursive_doubling"
    monkeypatch.setenv("PYCOLL_COST", "alpha=0")  # bandwidth is everything: ring, registered first
    assert Tuner(4).choose("all_reduce", 8) == "ring"
    given = Tuner(4, params=Params(alpha=1000, beta=0, gamma=0))
    assert given.source == "given" and given.choose("all_reduce", 64 << 20) == "recursive_doubling"


def test_a_crowded_host_prices_rounds_that_keep_more_ranks_busy_than_cores(monkeypatch):
    # World 3 on 2 vCPUs measured recursive doubling and halving-doubling (whose fold leaves
    # a rank idle) faster than ring up to ~1 MiB; the defaults switch to ring at 32 KiB.
    assert Tuner(3).choose("all_reduce", 128 << 10) == "ring"
    t = Tuner(3, cores=2)
    assert t.choose("all_reduce", 64 << 10) == "recursive_doubling"
    assert t.choose("all_reduce", 256 << 10) == "halving_doubling"
    assert t.choose("all_reduce", 4 << 20) == "ring"
    costs = t.costs("all_reduce", 3)
    crowded = Params(**{**vars(DEFAULT_PARAMS), "alpha": DEFAULT_PARAMS.alpha_crowded})
    base = algorithms.COSTS["all_reduce"]
    assert costs["ring"](3, 1 << 20, DEFAULT_PARAMS) == base["ring"](3, 1 << 20, crowded)
    assert costs["halving_doubling"] is base["halving_doubling"]      # 2 busy ranks: not crowded
    # World 4: every algorithm keeps 4 ranks busy, so alpha_crowded prices them all: the
    # latency-bound choice holds longer than with the defaults.
    assert Tuner(4).choose("all_reduce", 256 << 10) == "halving_doubling"
    assert Tuner(4, cores=2).choose("all_reduce", 256 << 10) == "recursive_doubling"
    assert Tuner(4, cores=4).table("all_reduce", 4) == Tuner(4).table("all_reduce", 4)
    monkeypatch.setenv("PYCOLL_COST", "alpha_crowded=38us")     # the defaults' alpha: no change
    assert Tuner(3, cores=2).table("all_reduce", 3) == Tuner(3).table("all_reduce", 3)


def _sits_out(sched) -> bool:
    """Only the fold's lone send and the unfold's lone receive: no exchange in the rounds."""
    comm = [step for step in sched.steps if any(isinstance(a, (Send, Recv, RecvReduce)) for a in step)]
    return len(comm) == 2 and all(len(step) == 1 for step in comm)


def test_busy_ranks_are_those_the_schedules_give_work():
    # busy(world) must agree with the schedules: the ranks that exchange in the rounds
    # (all of them for algorithms without a fold).
    for coll, algos in algorithms.MODULES.items():
        for name in algos:
            for w in range(1, 10):
                busy = algorithms.BUSY[coll][name](w)
                assert 1 <= busy <= w, (coll, name, w)
                if name not in ("recursive_doubling", "halving_doubling") or coll != "all_reduce":
                    assert busy == w, (coll, name, w)
    for name in ("recursive_doubling", "halving_doubling"):
        for w in range(1, 10):
            idle = [r for r, sched in enumerate(schedules("all_reduce", name, w, 64)) if _sits_out(sched)]
            assert algorithms.BUSY["all_reduce"][name](w) == w - len(idle), (name, w, idle)


def _tuner_cores(rank, world):
    comm = dist.distributed_c10d._get_default_group().communicator
    return comm.mode, comm.tuner.cores


@pytest.mark.parametrize("world", [2, 3])
def test_the_group_tells_the_tuner_when_its_tcp_ranks_outnumber_the_cores(world):
    import os
    cores = len(os.sched_getaffinity(0))
    want = cores if world > cores else None
    res = run_ranks(_tuner_cores, world, backend="pycoll", env={"PYCOLL_TRANSPORT": "tcp"})
    assert res == [("tcp", want)] * world, res
    # On shared memory (and hierarchically) not every rank runs the TCP rounds.
    res = run_ranks(_tuner_cores, world, backend="pycoll")
    assert res == [("shm", None)] * world, res


# -- PYCOLL_ALGO and per-group overrides ---------------------------------------------------

def test_parse_overrides():
    assert parse_overrides("all_reduce=ring, broadcast=binomial") == {"all_reduce": "ring", "broadcast": "binomial"}
    ring = parse_overrides("ring")
    assert ring["all_reduce"] == ring["all_gather"] == ring["reduce_scatter"] == "ring"
    with pytest.raises(ValueError, match="valid"):
        parse_overrides("all_reduce=nope")
    with pytest.raises(ValueError, match="no collective"):
        parse_overrides("nope")


def test_pycoll_algo_forces_every_size(monkeypatch):
    monkeypatch.setenv("PYCOLL_ALGO", "all_reduce=tree")
    t = Tuner(4)
    assert {t.choose("all_reduce", n) for n in (0, 8, 1 << 20, 1 << 30)} == {"tree"}
    assert t.choose("broadcast", 8) == "binomial"  # other collectives still computed
    monkeypatch.setenv("PYCOLL_ALGO", "ring")
    t = Tuner(4, {"all_gather": "bruck"})  # a group's own overrides win over the variable
    assert t.choose("all_reduce", 8) == "ring" and t.choose("all_gather", 1 << 30) == "bruck"


def test_override_after_the_table_is_built():
    t = Tuner(2)
    assert t.choose("all_reduce", 8) == "recursive_doubling"
    t.overrides["all_reduce"] = "tree"  # what pycoll.set_algorithm does
    assert t.choose("all_reduce", 8) == "tree"


# -- PYCOLL_DEBUG --------------------------------------------------------------------------

def test_debug_logs_the_table_once_per_collective_and_world(monkeypatch, caplog):
    monkeypatch.setenv("PYCOLL_DEBUG", "INFO")
    t = Tuner(4)
    with caplog.at_level(logging.INFO, logger="pycoll"):
        for n in (8, 1 << 20, 64 << 20):
            t.choose("all_reduce", n)
            t.choose("all_reduce", n, 2)
    logs = [r.getMessage() for r in caplog.records if r.name == "pycoll"]
    assert len(logs) == 2, logs
    four = next(m for m in logs if "all_reduce world 4" in m)
    for name in algorithms.COSTS["all_reduce"]:
        assert name in four
    bounds, names = t.table("all_reduce", 4)
    assert f"choice: {names[0]} <= " in four and str(bounds[0]) in four and str(bounds[0] + 1) in four
    assert "alpha 38 us" in four and "(defaults)" in four
    assert four.count("*") == len(four.splitlines()) - 3  # one choice marked per size row


def test_no_table_without_debug(caplog):
    with caplog.at_level(logging.INFO, logger="pycoll"):
        Tuner(4).choose("all_reduce", 8)
    assert not [r for r in caplog.records if r.name == "pycoll"]


# -- transports and groups -----------------------------------------------------------------

def test_transport_choice():
    assert choose_mode("auto", ["a"]) == "tcp"
    assert choose_mode("auto", ["a", "a"]) == "shm"
    assert choose_mode("auto", ["a", "a", "b", "b"]) == "hierarchical"
    assert choose_mode("auto", ["a", "b"]) == "tcp"
    assert choose_mode("TCP", ["a", "a"]) == "tcp"
    with pytest.raises(ValueError, match="one host"):
        choose_mode("shm", ["a", "b"])
    with pytest.raises(ValueError, match="choose one of"):
        choose_mode("carrier-pigeon", ["a"])


def _per_group(rank, world):
    sub = dist.new_group([0, 1, 2])
    pycoll.set_algorithm("all_reduce", "tree", group=sub)
    t = torch.arange(1000, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t, group=sub)
    default_algo = dist.distributed_c10d._get_default_group().communicator.tuner.choose("all_reduce", 8000)
    return sub.communicator.tuner.choose("all_reduce", 8000), default_algo, bool(
        (t == torch.arange(1000, dtype=torch.float64) * 6).all())


def test_set_algorithm_per_group():
    res = run_ranks(_per_group, 3, backend="pycoll", env={"PYCOLL_TRANSPORT": "tcp"})
    assert all(r == ("tree", "recursive_doubling", True) for r in res), res
