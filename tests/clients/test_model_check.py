"""The cost formulas of tools/model_check.py (= the table in docs/algorithms.md) as pure
functions, checked against the real schedules: no benchmark runs here.

``critical_path`` runs a rank's ``Schedule`` list under the textbook model: a communication
step starting at t posts its sends (a message arrives at t + alpha + beta * the bytes the step
sends: sends of one step share the link; send and receive overlap, full duplex); the step ends
when its sends are done and every receive has arrived (+ gamma * bytes for a receive-reduce);
a local Reduce costs gamma * bytes, a Copy nothing (the docs do not count local copies).
Messages match per ordered pair of ranks in order, as in the executor. With one of alpha,
beta, gamma set to 1 and the others to 0 this yields the formula's coefficient, so the docs
cannot drift from the code.
"""

from __future__ import annotations

import math

import pytest

from pycoll import algorithms
from pycoll.algorithms.schedule import Copy, Recv, RecvReduce, Reduce, Send
from tools import model_check as mc

ITEM = 4  # float32


def schedules(coll: str, algo: str, world: int, n: int) -> list:
    """Every rank's schedule for a message of n bytes in the docs' notation."""
    fn, count = algorithms.get(coll, algo), n // ITEM
    if coll == "broadcast":
        return [fn(r, world, count, 0) for r in range(world)]
    if coll == "reduce_scatter":
        return [fn(r, world, [count // world] * world) for r in range(world)]
    if coll == "all_to_all":
        return [fn(r, world, [count // world] * world, [count // world] * world)
                for r in range(world)]
    if coll == "barrier":
        return [fn(r, world) for r in range(world)]
    return [fn(r, world, count) for r in range(world)]


def critical_path(scheds: list, alpha: float, beta: float, gamma: float) -> float:
    world = len(scheds)
    idx, ready, posted = [0] * world, [0.0] * world, [False] * world
    sent: dict[tuple[int, int], list[float]] = {}   # (src, dst) -> arrival times, in order
    taken: dict[tuple[int, int], int] = {}
    progress = True
    while progress:
        progress = False
        for r, s in enumerate(scheds):
            if idx[r] == len(s.steps):
                continue
            step, t = s.steps[idx[r]], ready[r]
            if not any(isinstance(a, (Send, Recv, RecvReduce)) for a in step):
                ready[r] = t + sum(a.count * ITEM * gamma for a in step if isinstance(a, Reduce))
                assert all(isinstance(a, (Copy, Reduce)) for a in step)
                idx[r] += 1
                progress = True
                continue
            out = sum(a.count for a in step if isinstance(a, Send)) * ITEM
            done = t + alpha + out * beta if out or any(isinstance(a, Send) for a in step) else t
            if not posted[r]:
                for a in step:
                    if isinstance(a, Send):
                        sent.setdefault((r, a.peer), []).append(t + alpha + out * beta)
                posted[r] = progress = True
            need: dict[tuple[int, int], int] = {}
            ends = [done]
            for a in step:
                if isinstance(a, (Recv, RecvReduce)):
                    k = taken.get((a.peer, r), 0) + need.get((a.peer, r), 0)
                    arrivals = sent.get((a.peer, r), [])
                    if k >= len(arrivals):
                        break
                    need[(a.peer, r)] = need.get((a.peer, r), 0) + 1
                    red = a.count * ITEM * gamma if isinstance(a, RecvReduce) else 0.0
                    ends.append(arrivals[k] + red)
            else:
                for key, c in need.items():
                    taken[key] = taken.get(key, 0) + c
                ready[r], posted[r] = max(ends), False
                idx[r] += 1
                progress = True
    assert all(i == len(s.steps) for i, s in zip(idx, scheds)), "schedule deadlocked"
    return max(ready)


def coefficients(scheds: list) -> mc.Cost:
    return mc.Cost(*(critical_path(scheds, *unit) for unit in ((1, 0, 0), (0, 1, 0), (0, 0, 1))))


CASES = [(c, a) for c, algos in mc.MODELS.items() for a in algos]
N = 840 * ITEM * 8  # divisible by every world size below: chunks are even


@pytest.mark.parametrize("coll,algo", CASES)
def test_single_rank_costs_nothing(coll, algo):
    assert mc.MODELS[coll][algo](1, N) == mc.ZERO


@pytest.mark.parametrize("coll,algo", CASES)
@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_formula_matches_schedule(coll, algo, world):
    n = N // world if coll == "all_gather" else N  # all_gather's n: one rank's block
    model = mc.MODELS[coll][algo](world, n)
    scheds = schedules(coll, algo, world, n)
    sim = coefficients(scheds)
    if coll == "barrier":
        assert sim == model
        return
    if algo == "tree" and world & (world - 1):
        # off a power of two the binomial tree is shallower on some branches: an upper bound
        assert all(s <= m + 1e-9 for s, m in zip(sim, model)), (sim, model)
        return
    assert sim == pytest.approx(model, abs=1e-9), (sim, model)
    mixed = (3e-4, 7e-10, 2e-10)  # coefficients add up: the paths coincide
    assert critical_path(scheds, *mixed) == pytest.approx(
        sum(c * p for c, p in zip(model, mixed)), rel=1e-12)


@pytest.mark.parametrize("coll,algo", CASES)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_beta_term_is_the_busiest_ranks_bytes_sent(coll, algo, world):
    """At powers of two the beta term is what the busiest rank sends (Schedule.bytes_sent),
    except tree all-reduce, whose rank 0 receives and then sends n per level: 2x its sends."""
    n = N // world if coll == "all_gather" else N
    sent = max(s.bytes_sent(ITEM) for s in schedules(coll, algo, world, n))
    beta = mc.MODELS[coll][algo](world, n).beta
    assert beta == pytest.approx(2 * sent if algo == "tree" else sent)


def test_fold_adds_two_messages_of_n():
    for fn in (mc.ar_halving_doubling, mc.ar_recursive_doubling):
        a, b = fn(4, N), fn(5, N)
        assert (b.alpha - a.alpha, b.beta - a.beta, b.gamma - a.gamma) == (2, 2 * N, N)


def test_plans_force_every_algorithm_once():
    forced = [(c, a) for plan in mc.plans() for c, a in plan.items()]
    assert sorted(forced) == sorted(CASES)
    assert math.isclose(mc.predict_us(mc.ar_ring(4, 1 << 20), {"alpha": 1e-4, "beta": 1e-9,
                                                                 "gamma": 0.0}),
                        1e6 * (6e-4 + 1.5 * (1 << 20) * 1e-9))
