"""Partial all-reduce (eager-SGD): solo and majority semantics, the staleness bound,
conservation, round_info, both transports, and ddp's sync modes.

The bookkeeping (``pycoll.partial.rounds``) is pure and tested on plain numbers first; the
rest runs real ranks (pycoll/testing/ranks.py) over PYCOLL_TRANSPORT=tcp and shm.
"""

from __future__ import annotations

import collections
import random
import time

import pytest
import torch
import torch.distributed as dist

from pycoll.partial.rounds import NF, Contribution, Ledger, majority_initiator
from pycoll.testing.ranks import RankFailure, rank_store, run_ranks

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ("tcp", "shm")


# ---- pure bookkeeping ------------------------------------------------------------------
def test_majority_initiator_is_deterministic_and_spread():
    seq = [majority_initiator(7, k, 4) for k in range(4000)]
    assert seq == [majority_initiator(7, k, 4) for k in range(4000)]
    assert seq != [majority_initiator(8, k, 4) for k in range(4000)]
    counts = collections.Counter(seq)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 850


def _rows(world, k, slots):
    rows = [[0] * NF for _ in range(world)]
    for r, c in slots.items():
        rows[r] = c.row(k)
    return rows


def test_ledger_requires_ranks_left_out_too_long():
    led = Ledger(3, "solo", max_staleness=2)
    assert led.required() == ()                      # round 0: nobody is late yet
    for k in range(2):                               # rank 2 is left out of rounds 0 and 1
        info = led.close_round(_rows(3, k, {0: Contribution(1, k, k), 1: Contribution(1, k, k)}))
        assert info.contributors == (0, 1) and info.misses[2] == k + 1
    assert led.required() == (2,) and led.must_include(2) == 0 and led.must_include(0) is None
    info = led.close_round(_rows(3, 2, {0: Contribution(1, 2, 2), 2: Contribution(2, 0, 1)}))
    assert info.required == (2,) and info.ages[2] == (1, 2) and info.max_age == 2
    assert info.count == 3 and info.misses == (0, 1, 0)


def test_ledger_zero_staleness_is_synchronous():
    led = Ledger(2, "majority", max_staleness=0, seed=3)
    assert led.required() == (0, 1)
    assert led.may_initiate(majority_initiator(3, 0, 2))
    assert not led.may_initiate(1 - majority_initiator(3, 0, 2))


def test_ledger_flush_resets_and_rejects_double_counting():
    led = Ledger(2, "solo", max_staleness=1)
    led.close_round(_rows(2, 0, {0: Contribution(1, 0, 0, flushing=True)}))
    info = led.close_round(_rows(2, 1, {0: Contribution(0, flushing=True),
                                        1: Contribution(2, 0, 1, flushing=True)}))
    assert info.flush and led.base == 2 and led.last == [1, 1] and led.misses == [0, 0]
    with pytest.raises(RuntimeError, match="already contributed"):
        led.close_round(_rows(2, 2, {0: Contribution(1, 1, 1)}))
    with pytest.raises(ValueError):
        Ledger(2, "quorum", 1)
    with pytest.raises(ValueError):
        Ledger(2, "solo", -1)


# ---- real ranks ------------------------------------------------------------------------
def _conservation(rank, world, mode, k_max, steps, delay_s):
    import pycoll

    rng = random.Random(1000 + rank)
    par = pycoll.partial.PartialAllReduce(torch.zeros(3, 4, dtype=torch.float64), mode=mode,
                                          max_staleness=k_max, seed=5)
    submitted = torch.zeros(3, 4, dtype=torch.float64)
    received = torch.zeros(3, 4, dtype=torch.float64)
    paired = []
    for step in range(steps):
        time.sleep(rng.random() * delay_s * (rank + 1))     # higher ranks are slower on average
        x = torch.randint(-1000, 1000, (3, 4)).double()
        submitted += x
        work = par.submit(x)
        received += work.wait()
        assert work.round == step and work.is_completed()
        paired.append(work.info)
    late = par.flush()
    for res in late:
        received += res.tensor
    par.close()   # after close every rank has seen every round, the same ones
    history = list(par.history)
    return {"submitted": submitted, "received": received, "paired": paired,
            "late": [r.info for r in late], "history": history}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_conservation_and_bound_under_random_delays(mode, transport):
    world, k_max, steps = 3, 2, 30
    out = run_ranks(_conservation, world, mode, k_max, steps, 0.004, backend="pycoll", timeout=50,
                    env={"PYCOLL_TRANSPORT": transport})
    total = sum(o["submitted"] for o in out)
    for o in out:  # every rank sees every round: the sum of all results is all that was submitted
        assert torch.equal(o["received"], total)
        assert o["history"] == out[0]["history"]          # round_info is the same everywhere
    paired = out[0]["paired"]
    assert [i.round for i in out[0]["history"]] == list(range(len(out[0]["history"])))
    assert sum(i.count for i in out[0]["history"]) == world * steps
    assert max(i.max_age for i in paired) <= k_max
    assert max(max(i.misses) for i in paired) <= k_max
    assert all(i.initiators for i in paired)
    if mode == "majority":
        assert all(i.initiators == (majority_initiator(5, i.round, world),) for i in paired)
    # a progress thread may start one more, empty, round while the flush completes elsewhere
    hist = out[0]["history"]
    last_flush = max(i for i, r in enumerate(hist) if r.flush)
    assert all(sum(r.counts) == 0 for r in hist[last_flush + 1:]), hist[last_flush:]


def test_conservation_with_fault_injected_delays():
    out = run_ranks(_conservation, 2, "solo", 1, 20, 0.0, backend="pycoll", timeout=50,
                    env={"PYCOLL_FAULT": "rank=1:delay=0.003"})
    assert torch.equal(out[0]["received"], out[0]["submitted"] + out[1]["submitted"])
    assert max(i.max_age for i in out[0]["paired"]) <= 1


def _solo_first_arrival(rank, world):
    import pycoll

    store = rank_store()
    par = pycoll.partial.PartialAllReduce(torch.zeros(2), mode="solo", max_staleness=3)
    if rank == 1:   # arrives only once rank 0 has round 0's result: had round 0 waited, a hang
        store.wait(["round 0 done"])
    r0 = par.submit(torch.full((2,), float(rank + 1))).result()
    if rank == 0:
        store.set("round 0 done", "1")
    r1 = par.submit(torch.full((2,), 10.0 * (rank + 1))).result()
    late = par.flush()
    par.close()
    return r0, r1, late


@pytest.mark.parametrize("backend,transport", [("pycoll", "tcp"), ("pycoll", "shm"), ("gloo", "")])
def test_solo_first_arrival_triggers_and_late_deposit_carries_over(backend, transport):
    # pycoll: the waiting all-reduce sends the activation (slow_wait); gloo: the progress
    # thread's timer does
    (a0, a1, alate), (b0, b1, _) = run_ranks(
        _solo_first_arrival, 2, backend=backend, timeout=30, env={"PYCOLL_TRANSPORT": transport or "auto"})
    assert a0.info == b0.info and a1.info == b1.info
    assert a0.info.initiators == (0,) and a0.info.contributors == (0,)
    assert a0.tensor.tolist() == [1.0, 1.0] and a0.count == 1
    # Rank 1's late deposit is in a later round, with its age; nothing lost or doubled.
    rounds = [a1] + alate
    where = [r for r in rounds if r.info.counts[1]]
    assert sum(r.info.counts[1] for r in rounds) == 2 and where[0].info.ages[1][1] >= 1
    assert sum(r.tensor[0].item() for r in [a0] + rounds) == 1 + 10 + 2 + 20


def _majority_waits_for_initiator(rank, world, seed):
    import pycoll

    slow = majority_initiator(seed, 0, world)
    par = pycoll.partial.PartialAllReduce(torch.zeros(1), mode="majority", max_staleness=4, seed=seed)
    if rank == slow:
        time.sleep(0.2)
    t0 = time.perf_counter()
    res = par.submit(torch.ones(1)).result()
    waited = time.perf_counter() - t0
    par.flush()
    par.close()
    return res.info, waited, slow


def test_majority_round_waits_for_its_initiator():
    out = run_ranks(_majority_waits_for_initiator, 3, 11, backend="pycoll", timeout=30)
    info, _, slow = out[0]
    assert info.initiators == (slow,) and slow in info.contributors
    for rank, (_, waited, _) in enumerate(out):
        if rank != slow:
            assert waited > 0.1  # nobody started round 0 without its initiator


def _always_slow(rank, world, k_max, steps):
    import pycoll

    par = pycoll.partial.PartialAllReduce(torch.zeros(2, dtype=torch.int64), mode="solo",
                                          max_staleness=k_max)
    ahead = []
    for step in range(steps):
        if rank == 1:
            time.sleep(0.02)                  # a permanently slow rank
        work = par.submit(torch.ones(2, dtype=torch.int64))
        work.wait()
        ahead.append(par.last_round.round - step)   # rounds run ahead of this rank's steps
    par.flush()
    history = list(par.history)
    par.close()
    return history, ahead


@pytest.mark.parametrize("k_max", [0, 2])
def test_staleness_bound_is_enforced_for_a_permanently_slow_rank(k_max):
    steps = 12
    (history, ahead0), (_, ahead1) = run_ranks(_always_slow, 2, k_max, steps, backend="pycoll", timeout=30)
    body = [i for i in history if i.round < steps]
    assert all(i.misses[1] <= k_max for i in body)                 # never left out > K in a row
    assert all(i.ages[1] is None or i.ages[1][1] <= k_max for i in body)   # never older than K
    if k_max == 0:
        assert all(i.counts == (1, 1) and i.max_age == 0 for i in body)   # synchronous
    else:
        assert any(i.required == (1,) for i in body)                 # the bound made rounds wait
        assert any(i.ages[1] and i.ages[1][1] == k_max for i in body)
    assert max(ahead1) <= k_max and max(ahead0) <= 0


def _lent_buffers(rank, world, delay):
    import pycoll

    par = pycoll.partial.PartialAllReduce(torch.zeros(5, dtype=torch.float64), mode="solo",
                                          max_staleness=2, activation_delay=delay)
    total = torch.zeros(5, dtype=torch.float64)
    for step in range(20):
        buf = par.buffer()                  # filled in place, deposited without a copy
        buf.fill_(rank + step)
        res = par.all_reduce(buf)
        total += res.tensor
        par.recycle(res)                    # its buffer serves a later deposit
    for res in par.flush():
        total += res.tensor
    with pytest.raises(ValueError, match="not a round result"):
        par.recycle(pycoll.partial.RoundResult(torch.zeros(5, dtype=torch.float64), 0, None))
    sent = par._server._act.sent
    par.close()
    return total, sent


def test_lent_buffers_and_recycling_conserve_and_balanced_rounds_send_no_activation():
    out = run_ranks(_lent_buffers, 2, 5.0, backend="pycoll", timeout=30)
    expected = sum(r + s for r in range(2) for s in range(20))
    for total, sent in out:
        assert total.tolist() == [float(expected)] * 5
        assert sent == 0        # every round completed within the grace period: no message


def _errors(rank, world):
    import pycoll

    par = pycoll.partial.PartialAllReduce(torch.zeros(4))
    with pytest.raises(ValueError, match="expected"):
        par.submit(torch.zeros(5))
    with pytest.raises(TypeError):
        pycoll.partial.PartialAllReduce(torch.zeros(2, dtype=torch.float16))
    par.close()
    with pytest.raises(pycoll.PycollError, match="after close"):
        par.submit(torch.zeros(4))
    return True


def test_misuse_raises_clear_errors():
    assert run_ranks(_errors, 2, backend="pycoll", timeout=30) == [True, True]


# ---- ddp -------------------------------------------------------------------------------
def _ddp_train(rank, world, sync, steps, delay):
    import ddp
    from tests.support.ddp_models import mlp

    torch.manual_seed(0)
    model = ddp.DistributedDataParallel(mlp(), sync=sync, max_staleness=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    w_true = torch.randn(6, 3, generator=torch.Generator().manual_seed(9))
    losses = []
    for _ in range(steps):
        if delay and random.random() < 0.5:
            time.sleep(delay)
        x = torch.randn(16, 6, generator=gen)
        loss = ((model(x) - x @ w_true) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    counts = None
    if model.partial is not None:
        model.partial.close()                    # flushes: late gradients land in extra rounds
        counts = [i.count for i in model.partial.allreduce.history]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, losses, counts


@pytest.mark.parametrize("sync", ["solo", "majority"])
def test_ddp_partial_sync_trains_like_full_sync(sync):
    steps = 40
    full = run_ranks(_ddp_train, 2, "full", steps, 0.0, backend="pycoll", timeout=40)
    part = run_ranks(_ddp_train, 2, sync, steps, 0.0, backend="pycoll", timeout=40)
    assert torch.equal(part[0][0], part[1][0])        # replicas identical at equal step counts
    full_loss = sum(full[0][1][-10:]) / 10
    part_loss = sum(part[0][1][-10:]) / 10
    assert part_loss < 0.5 * sum(part[0][1][:5]) / 5  # it learns
    assert abs(part_loss - full_loss) <= 0.25 * full_loss + 1e-3
    rel = (part[0][0] - full[0][0]).norm() / full[0][0].norm()
    assert rel < 0.1
    assert sum(part[0][2]) == 2 * steps              # every gradient applied exactly once


def test_ddp_partial_sync_with_stragglers_keeps_replicas_identical():
    out = run_ranks(_ddp_train, 2, "solo", 20, 0.01, backend="pycoll", timeout=40,
                    env={"PYCOLL_TRANSPORT": "tcp"})
    assert torch.equal(out[0][0], out[1][0]) and sum(out[0][2]) == 40


class _OutOfOrder(torch.nn.Module):
    """Layers registered c, a, b but used a, b, c: gradients become ready in an order that is
    not reverse registration order, so rebuilt buckets are no single range of the deposit."""

    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Linear(8, 1)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _ddp_many_buckets(rank, world, sync, shape):
    import ddp
    from tests.support.ddp_models import mlp

    torch.manual_seed(0)
    # tiny buckets: several per step, rebuilt after the first step (a new layout); every
    # parameter's average must come back to that parameter, from any bucket
    model = ddp.DistributedDataParallel(mlp() if shape == "mlp" else _OutOfOrder(), sync=sync,
                                        max_staleness=0, bucket_cap_mb=0.0005,
                                        first_bucket_cap_mb=0.0002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x = torch.randn(16, 6, generator=gen)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    buckets = len(model.reducer.buckets)
    paths = set()
    if model.partial is not None:
        paths = {r is not None for r in model.partial._ranges.values()}   # one range / per parameter
        model.partial.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), buckets, paths


@pytest.mark.parametrize("shape", ["mlp", "out_of_order"])
def test_ddp_partial_sync_with_many_rebuilt_buckets_equals_full_sync_at_zero_staleness(shape):
    full = run_ranks(_ddp_many_buckets, 2, "full", shape, backend="pycoll", timeout=40)
    solo = run_ranks(_ddp_many_buckets, 2, "solo", shape, backend="pycoll", timeout=40)
    assert full[0][1] > 1 and solo[0][1] > 1                    # really several buckets
    if shape == "out_of_order":     # buckets that are one deposit range and buckets that are not
        assert solo[0][2] == {True, False}, solo[0][2]
    for (pf, _, _), (ps, _, _) in zip(full, solo):              # K = 0: synchronous SGD
        assert torch.allclose(pf, ps, rtol=1e-5, atol=1e-6), (pf - ps).abs().max()


def _ddp_refuses(rank, world):
    import ddp
    from tests.support.ddp_models import batchnorm, mlp

    with pytest.raises(ValueError, match="sync must be one of"):
        ddp.DistributedDataParallel(mlp(), sync="quorum")
    with pytest.raises(ValueError, match="find_unused_parameters"):
        ddp.DistributedDataParallel(mlp(), sync="solo", find_unused_parameters=True)
    with pytest.raises(ValueError, match="broadcast_buffers=False"):
        ddp.DistributedDataParallel(batchnorm(), sync="majority")
    return True


def test_ddp_partial_sync_refuses_per_step_collectives():
    assert run_ranks(_ddp_refuses, 2, backend="pycoll", timeout=30) == [True, True]


def test_dead_rank_fails_the_others_instead_of_hanging():
    with pytest.raises(RankFailure, match="rank 0 failed(.|\n)*rank 1"):
        run_ranks(_dies_midway, 2, backend="pycoll", timeout=20, may_die=(1,))


def _dies_midway(rank, world):
    import os
    import signal

    import pycoll

    par = pycoll.partial.PartialAllReduce(torch.zeros(2), mode="solo", max_staleness=1, timeout=5)
    for step in range(5):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        par.submit(torch.ones(2)).wait(timeout=8)
    return dist.get_rank()


def _quiet_longer_than_timeout(rank, world):
    import threading

    import pycoll

    # balanced rounds send no activation (none can: the grace period outlasts the test), yet
    # the posted activation receive is bounded by the group timeout (2 s here): keepalives
    # must complete it in time, again and again
    par = pycoll.partial.PartialAllReduce(torch.zeros(4), mode="solo", timeout=2.0, activation_delay=30.0)
    rounds, total, end = 0, torch.zeros(4), time.monotonic() + 3.5
    while time.monotonic() < end:
        total += par.all_reduce(torch.ones(4)).tensor
        rounds += 1
        time.sleep(0.01)
    for res in par.flush():
        total += res.tensor
    sent = par._server._act.sent
    par.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("pycoll-partial")]
    return rounds, total.tolist(), sent, left


@pytest.mark.parametrize("backend", ["pycoll", "gloo"])
def test_rounds_go_on_past_the_group_timeout_without_activations(backend):
    out = run_ranks(_quiet_longer_than_timeout, 2, backend=backend, timeout=40)
    deposits = sum(rounds for rounds, _, _, _ in out)
    for rounds, total, sent, left in out:
        assert rounds > 50 and sent == 0, out
        assert total == [float(deposits)] * 4, out    # every deposit in exactly once
        assert left == [], out      # no thread stays behind in a receive (gloo: a blocking wait)
