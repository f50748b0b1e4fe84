"""pycoll on a busy machine: waits that leave the core to whoever needs it (issue 33).

Each test starts busy processes beside two pooled ranks (``pycoll.cli.bench.load.Busy``):
as many as make the ranks plus them one more than the cores, so that someone always waits
for a core, as on a user's machine with DataLoader workers or a second job. Then:

- a 4 MiB all_reduce on pycoll costs no more than gloo's in the same ranks, interleaved,
  medians (a ratio with a generous margin, never an absolute time). The bench put the spin
  decided at init at 0.25-0.62x gloo; in this short harness the old tree passes too, so this
  one guards against falling below gloo rather than proving the fix;
- a rank that waits for a peer busy computing leaves it the core: its CPU time stays a
  small share of the wall time it waited (under 35%; 8-13% measured here, 26% once in CI
  on torch 2.15). A spin decided at init burned about half (48-52% in one of the two
  transports in each run of the old tree).

Both over shared memory (the default on one host) and over TCP.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from pycoll.cli.bench.load import Busy
from pycoll.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(180)

CORES = os.cpu_count() or 1
BUSY = CORES - 1         # two ranks + BUSY = cores + 1 runnable tasks
TRANSPORTS = [pytest.param({}, id="shm"), pytest.param({"PYCOLL_TRANSPORT": "tcp"}, id="tcp")]
needs_few_cores = pytest.mark.skipif(not 2 <= CORES <= 8, reason="busy processes for 2-8 cores")


def _interleaved(rank, world, numel, rounds, per_round):
    torch.set_num_threads(1)          # as torchrun sets it
    pg = dist.new_group(backend="pycoll")
    gloo = dist.new_group(backend="gloo")
    t = torch.ones(numel)
    times = {"pycoll": [], "gloo": []}
    for g in (pg, gloo):
        dist.all_reduce(t, group=g)   # connections and first-touch out of the timings
    for r in range(rounds):
        order = (("pycoll", pg), ("gloo", gloo)) if r % 2 == 0 else (("gloo", gloo), ("pycoll", pg))
        for name, g in order:
            for _ in range(per_round):
                dist.barrier(group=gloo)      # every op starts in step, whichever backend
                t.fill_(1)
                t0 = time.perf_counter()
                dist.all_reduce(t, group=g)
                times[name].append(time.perf_counter() - t0)
                assert t[0].item() == world and t[-1].item() == world
    dist.destroy_process_group(pg)
    dist.destroy_process_group(gloo)
    return {k: statistics.median(v) for k, v in times.items()}


@needs_few_cores
@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_4mib_all_reduce_beside_busy_processes_costs_no_more_than_gloo(env):
    with Busy(BUSY):
        res = run_ranks(_interleaved, 2, (4 << 20) // 4, 8, 5, backend="gloo", env=env, timeout=150)
    mine, gloo = res[0]["pycoll"], res[0]["gloo"]
    assert mine <= 1.5 * gloo, f"pycoll {mine * 1e3:.2f} ms, gloo {gloo * 1e3:.2f} ms: {res}"


def _wait_for_a_computing_peer(rank, world, ops, compute):
    torch.set_num_threads(1)
    pg = dist.new_group(backend="pycoll")
    t = torch.ones(8)
    dist.all_reduce(t, group=pg)
    ok = True
    cpu0, wall0 = time.process_time(), time.monotonic()
    for i in range(ops):
        if rank == 1:                 # computes (on a core) before each op: rank 0 waits
            end = time.perf_counter() + compute
            while time.perf_counter() < end:
                pass
        t.fill_(i * 2 + rank)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        ok &= bool((t == i * 2 + 1).all())
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    dist.destroy_process_group(pg)
    return cpu, wall, ok


@needs_few_cores
@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_rank_waiting_for_a_computing_peer_leaves_the_core_on_a_busy_machine(env):
    # Rank 1 computes 1.5 ms before each of 150 all_reduces, beside busy processes. A rank
    # that spins through its waits (2 ms, 16 ms after one that slept: the rule decided at
    # init) uses about all of its wall time; one that yields, a small share.
    with Busy(BUSY):
        res = run_ranks(_wait_for_a_computing_peer, 2, 150, 0.0015, backend="gloo", env=env, timeout=150)
    cpu, wall, _ = res[0]
    assert all(r[2] for r in res), res
    assert cpu < 0.35 * wall, res
