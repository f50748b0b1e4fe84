"""When a wait polls before it blocks (``waits``, ``core.setup.tcp_spin``, the arena's barriers).

Real groups over loopback TCP and shared memory on the reused rank pool: the group sets
its TCP budget only when every local rank has a core to spare, ``PYCOLL_TCP_SPIN_US`` sets
or disables it, the group's worker thread (asynchronous ops) spins 0.1 ms at most while the
caller's thread spins the budget, and a rank that waits for a late peer spins once, then blocks: its CPU time
stays far below the wall time it waited, inline and in the worker alike. The same cap holds
for the worker's shared-memory barriers (it runs DDP's buckets while backward computes).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

CORES = len(os.sched_getaffinity(0))


def _budget(rank, world, threads):
    from pycoll.transport import waits

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pg = dist.new_group(backend="pycoll")
        spin = pg.communicator.tcp.spin
        seen = {}

        def task(seq, deadline):
            seen["worker"] = (threading.current_thread().name, waits.spin_cap())
        work = pg.communicator.submit("probe", [], task, False)
        while not work.is_completed():   # not wait(): it would run the op in this thread
            time.sleep(0.001)
        dist.destroy_process_group(pg)
        return spin, waits.spin_cap(), seen["worker"]
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(CORES < 2, reason="two ranks need a core each to spin")
def test_the_budget_needs_cores_to_spare_and_the_worker_spins_briefly():
    res = run_ranks(_budget, 2, 1, backend="gloo", env={"PYCOLL_TRANSPORT": "tcp"})
    for spin, caller, (name, worker) in res:
        assert spin == pytest.approx(0.001) and caller == float("inf"), res
        assert name.startswith("pycoll-worker") and worker == pytest.approx(100e-6), res
    res = run_ranks(_budget, 2, CORES, backend="gloo", env={"PYCOLL_TRANSPORT": "tcp"})
    assert [r[0] for r in res] == [0.0, 0.0], res
    res = run_ranks(_budget, 2, 1, backend="gloo", env={"PYCOLL_TRANSPORT": "tcp", "PYCOLL_TCP_SPIN_US": "0"})
    assert [r[0] for r in res] == [0.0, 0.0], res
    res = run_ranks(_budget, 2, 1, backend="gloo", env={"PYCOLL_TRANSPORT": "tcp", "PYCOLL_TCP_SPIN_US": "250"})
    assert [r[0] for r in res] == [pytest.approx(0.00025)] * 2, res


def _late_peer(rank, world, asynchronous):
    before = torch.get_num_threads()
    torch.set_num_threads(1)      # as torchrun sets it: the group may spin
    try:
        return _wait_for_late_peer(rank, asynchronous)
    finally:
        torch.set_num_threads(before)


def _wait_for_late_peer(rank, asynchronous):
    pg = dist.new_group(backend="pycoll")
    spin = pg.communicator.tcp.spin
    t = torch.ones(8)
    dist.all_reduce(t, group=pg)
    if rank == 1:
        time.sleep(0.5)
    cpu0, wall0 = time.process_time(), time.monotonic()
    if asynchronous:        # the worker runs it while this thread sleeps
        work = dist.all_reduce(t, group=pg, async_op=True)
        while not work.is_completed():
            time.sleep(0.01)
    else:
        dist.all_reduce(t, group=pg)
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - wall0
    ok = bool((t == 4).all())
    dist.destroy_process_group(pg)
    return cpu, wall, ok, spin


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_rank_waiting_for_a_late_peer_spins_once_then_blocks(asynchronous):
    res = run_ranks(_late_peer, 2, asynchronous, backend="gloo", env={"PYCOLL_TRANSPORT": "tcp"})
    cpu, wall, ok, spin = res[0]
    assert all(r[2] for r in res) and (spin > 0 or CORES < 2), res
    assert wall > 0.4, res
    # Spinning through the wait would cost about the whole 0.5 s of CPU.
    assert cpu < 0.1, res


def test_adaptive_spin_halves_unanswered_spins_and_probes_the_whole_budget():
    from pycoll.transport.waits import AdaptiveSpin

    s = AdaptiveSpin(0.001)
    got = []
    for _ in range(AdaptiveSpin.PROBE - 1):      # every spin ends unanswered
        b = s.budget()
        got.append(b)
        if b:
            s.unanswered(b)
    assert got[:6] == pytest.approx([0.001, 0.0005, 0.00025, 0.000125, 0.0000625, 0.00003125])
    assert got[6:] == [0.0] * (AdaptiveSpin.PROBE - 7)       # under 25 us: no spin at all
    assert s.budget() == 0.001                                # the probe
    s.answered()                                              # it paid: spinning pays again
    assert s.budget() == 0.001 and s.budget() == 0.001


def _budget_after_late_then_timely_peers(rank, world):
    before = torch.get_num_threads()
    torch.set_num_threads(1)      # as torchrun sets it: the group may spin
    try:
        pg = dist.new_group(backend="pycoll")
        tcp = pg.communicator.tcp
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)
        for _ in range(8):        # rank 0's spins go unanswered: its budget decays to none
            if rank == 1:
                time.sleep(0.02)
            dist.all_reduce(t, group=pg)
        decayed = tcp._spins.now
        if rank == 0:             # the peer's frames are there before rank 0 looks: no wait at all
            time.sleep(0.05)
        dist.all_reduce(t, group=pg)
        restored = tcp._spins.now
        ok = bool((t == 2 ** 10).all())
        dist.destroy_process_group(pg)
        return decayed, restored, tcp.spin, ok
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(CORES < 2, reason="two ranks need a core each to spin")
def test_a_step_that_never_blocks_restores_the_whole_budget():
    # A step whose peer's frames were already there never spins; it must still count as a
    # peer in time, or a budget decayed by a few late peers stays at none, and every later
    # op blocks and pays the VM's wake-ups (120-300 us all_reduces, docs/performance.md).
    res = run_ranks(_budget_after_late_then_timely_peers, 2, backend="gloo",
                    env={"PYCOLL_TRANSPORT": "tcp"})
    decayed, restored, full, ok = res[0]
    assert all(r[3] for r in res) and full > 0, res
    assert decayed < full / 8, res
    assert restored == full, res


def _often_late_peer(rank, world, ops, late):
    before = torch.get_num_threads()
    torch.set_num_threads(1)      # as torchrun sets it: the group may spin
    try:
        pg = dist.new_group(backend="pycoll")
        arena = pg.communicator.arena
        spin = arena.spin if arena is not None else None
        t = torch.ones(8)
        dist.all_reduce(t, group=pg)
        cpu0 = time.process_time()
        for _ in range(ops):
            if rank == 1:
                time.sleep(late)
            work = dist.all_reduce(t, group=pg, async_op=True)   # the worker runs it
            while not work.is_completed():
                time.sleep(0.001)
        cpu = time.process_time() - cpu0
        ok = bool((t == 2 ** (ops + 1)).all())
        dist.destroy_process_group(pg)
        return cpu, ok, spin
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(CORES < 2, reason="two ranks need a core each to spin")
def test_the_workers_shared_memory_barriers_spin_briefly():
    # Rank 0's worker waits ~5 ms for rank 1 in each of 20 all_reduces. A barrier that
    # spins (2 ms, 16 ms after one that slept) burns about that whole wait: ~100 ms of CPU;
    # the worker's 0.1 ms a barrier, 2 ms.
    res = run_ranks(_often_late_peer, 2, 20, 0.005, backend="gloo")
    cpu, ok, spin = res[0]
    assert all(r[1] for r in res) and spin and spin > 0, res
    assert cpu < 0.03, res
