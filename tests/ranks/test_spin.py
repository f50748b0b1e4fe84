"""When a wait polls before it blocks (``transport.spin``, ``core.setup.tcp_spin``, the arena's barriers).

The policy's decisions on a machine state held still (``RunnableTasks.running`` fixed), then
real groups over loopback TCP and shared memory on the reused rank pool:
``PYCOLL_TCP_SPIN_US`` sets or disables the TCP budget, the group's worker thread
(asynchronous ops) spins 0.1 ms at most while the caller's thread spins the budget, and a
rank that waits for a late peer spins once, then blocks: its CPU time stays far below the
wall time it waited, inline and in the worker alike. The same cap holds for the worker's
shared-memory barriers (it runs DDP's buckets while backward computes). The tests that hold
the waits to the machine as it is (busy processes beside the ranks) are in test_load.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pycoll.transport import spin
from pycoll.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(120)

CORES = len(os.sched_getaffinity(0))


class Machine(spin.RunnableTasks):
    """The runnable count held at ``n`` (the policy's input), on the real cores."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def running(self):
        return self.n


def _wait(policy, t0, seconds):
    """Poll as a wait does, from ``t0`` for at most ``seconds``: how long it polled."""
    now = t0
    if not policy.begin(now):
        return 0.0
    while now - t0 < seconds:
        now = time.monotonic()
        if not policy.poll(now):
            break
    return now - t0


def test_a_quiet_machine_lets_a_wait_poll_its_whole_budget():
    m = Machine(1)
    p = spin.SpinPolicy(0.001, m)
    t0 = time.monotonic()
    polled = _wait(p, t0, 1.0)
    assert 0.001 <= polled < 0.5 and p.spun_out
    p.unanswered()
    assert p.learned.now == pytest.approx(0.0005)   # unanswered: half next time
    p.answered()
    assert p.learned.now == 0.001
    m.close()


def test_a_crowded_machine_ends_the_spin_at_the_first_read_past_the_grace_then_blocks_at_once():
    m = Machine((os.cpu_count() or 1) + 1)
    p = spin.SpinPolicy(0.010, m)
    t0 = time.monotonic()
    polled = _wait(p, t0, 1.0)
    assert spin.GRACE <= polled < 0.005 and not p.spun_out
    p.unanswered()
    assert p.learned.now == 0.010      # a crowd says nothing about the peers
    assert not p.begin(time.monotonic())       # told lately: block without polling
    m.n = 1
    assert p.begin(time.monotonic() + 2 * spin.MEMORY)   # the memory fades
    m.close()


def test_a_task_that_wakes_mid_spin_ends_it():
    m = Machine(1)
    p = spin.SpinPolicy(0.010, m)
    t0 = now = time.monotonic()
    assert p.begin(now)
    while now - t0 < 3 * spin.RECHECK:
        now = time.monotonic()
        assert p.poll(now)
    m.n = m.cores + 1
    end = now + 2 * spin.RECHECK
    while now < end and p.poll(now):
        now = time.monotonic()
    assert now < end and m.verdict and not p.spun_out
    m.close()


def test_the_real_count_includes_this_process():
    m = spin.RunnableTasks()
    assert m.fd is not None and m.running() >= 1
    m.close()
    assert m.fd is None and m.running() == 0 and not m.crowded(time.monotonic())


def test_the_worker_polls_briefly_and_learns_nothing_from_it():
    seen = {}

    def worker():
        spin.run_in_background()
        p = spin.SpinPolicy(0.001, Machine(1))
        seen["polled"] = _wait(p, time.monotonic(), 1.0)
        p.unanswered()
        seen["now"] = p.learned.now
        p.tasks.close()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert spin.BACKGROUND_SPIN <= seen["polled"] < 0.001 and seen["now"] == 0.001, seen
    assert spin.spin_cap() == float("inf")


def _budget(rank, world, threads):
    from pycoll.transport import spin

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pg = dist.new_group(backend="pycoll")
        budget = pg.communicator.tcp.spin
        seen = {}

        def task(seq, deadline):
            seen["worker"] = (threading.current_thread().name, spin.spin_cap())
        work = pg.communicator.submit("probe", [], task, False)
        while not work.is_completed():   # not wait(): it would run the op in this thread
            time.sleep(0.001)
        dist.destroy_process_group(pg)
        return budget, spin.spin_cap(), seen["worker"]
    finally:
        torch.set_num_threads(before)


def test_the_budget_is_a_ceiling_whatever_the_threads_and_the_worker_spins_briefly():
    # Whether a wait polls is decided per wait, from the machine as it is: the budget is the
    # same with one intra-op thread as with one per core (it was 0 with as many, at init).
    for threads in (1, CORES):
        res = run_ranks(_budget, 2, threads, backend="gloo", env={"PYCOLL_TRANSPORT": "tcp"})
        for budget, caller, (name, worker) in res:
            assert budget == pytest.approx(0.001) and caller == float("inf"), res
            assert name.startswith("pycoll-worker") and worker == pytest.approx(100e-6), res
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
    budget = pg.communicator.tcp.spin
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
    return cpu, wall, ok, budget


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_rank_waiting_for_a_late_peer_spins_once_then_blocks(asynchronous):
    res = run_ranks(_late_peer, 2, asynchronous, backend="gloo", env={"PYCOLL_TRANSPORT": "tcp"})
    cpu, wall, ok, budget = res[0]
    assert all(r[2] for r in res) and budget > 0, res
    assert wall > 0.4, res
    # Spinning through the wait would cost about the whole 0.5 s of CPU.
    assert cpu < 0.1, res


def test_adaptive_spin_halves_unanswered_spins_and_probes_the_whole_budget():
    from pycoll.transport.spin import AdaptiveSpin

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
        decayed = tcp._spins.learned.now
        if rank == 0:             # the peer's frames are there before rank 0 looks: no wait at all
            time.sleep(0.05)
        dist.all_reduce(t, group=pg)
        restored = tcp._spins.learned.now
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
        budget = arena.spin if arena is not None else None
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
        return cpu, ok, budget
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(CORES < 2, reason="two ranks need a core each to spin")
def test_the_workers_shared_memory_barriers_spin_briefly():
    # Rank 0's worker waits ~5 ms for rank 1 in each of 20 all_reduces. A barrier that
    # spins its whole 2 ms burns about that whole wait: ~100 ms of CPU;
    # the worker's 0.1 ms a barrier, 2 ms.
    res = run_ranks(_often_late_peer, 2, 20, 0.005, backend="gloo")
    cpu, ok, budget = res[0]
    assert all(r[1] for r in res) and budget and budget > 0, res
    assert cpu < 0.03, res
