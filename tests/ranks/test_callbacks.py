"""User callbacks never run where pycoll needs to make progress, and errors reach torch's C++.

A future callback that issues a collective and waits for it (torch's PowerSGD DDP hook does
this) must complete, on every transport, for collectives and for point-to-point; a peer that
dies under torch DDP or ``ddp/`` must make the survivor raise a Python exception naming the
dead rank, never crash it. ``callbacks.Runner`` is unit-tested without processes.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pycoll import callbacks
from pycoll.testing.ranks import rank_store, run_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

TRANSPORTS = ["shm", "tcp"]


# -- the runner, in one process -----------------------------------------------------------
def _on_internal(runner, fn):
    """Run ``fn`` on a thread marked internal (as a pycoll thread is); wait for it."""
    t = callbacks.start_thread(fn, lambda exc: None, "pycoll-test-internal", runner)
    t.join(10)
    assert not t.is_alive()


def test_callbacks_from_an_internal_thread_run_elsewhere_and_inline_on_a_user_thread():
    runner = callbacks.Runner("pycoll-test-callbacks")
    seen = []
    done = threading.Event()

    def job():
        seen.append((threading.current_thread().name, callbacks.is_internal()))
        done.set()

    _on_internal(runner, lambda: callbacks.deliver(job))
    assert done.wait(5)
    assert seen == [("pycoll-test-callbacks", False)]
    callbacks.deliver(job)   # a user thread: inline
    assert seen[-1] == (threading.current_thread().name, False)
    runner.close()


def test_a_callback_that_waits_for_a_later_callback_does_not_deadlock():
    """Job A blocks until job B has run: B must get a thread of its own."""
    runner = callbacks.Runner("pycoll-test-callbacks")
    b_ran = threading.Event()
    a_done = threading.Event()

    def a():
        assert b_ran.wait(5), "job B never ran while job A waited for it"
        a_done.set()

    def submit_both():
        callbacks.deliver(a)
        time.sleep(0.05)
        callbacks.deliver(b_ran.set)

    _on_internal(runner, submit_both)
    assert a_done.wait(10)
    runner.close()


def test_a_failing_internal_thread_fails_its_owner():
    runner = callbacks.Runner("pycoll-test-callbacks")
    failures = []
    t = callbacks.start_thread(lambda: 1 / 0, failures.append, "pycoll-test-internal", runner)
    t.join(5)
    assert len(failures) == 1 and isinstance(failures[0], ZeroDivisionError)
    runner.close()


def test_closed_runner_threads_end():
    runner = callbacks.Runner("pycoll-test-closing")
    _on_internal(runner, lambda: callbacks.deliver(lambda: None))
    time.sleep(0.1)
    runner.close()
    deadline = time.monotonic() + 5
    while any(t.name == "pycoll-test-closing" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "runner threads outlived close()"
        time.sleep(0.01)


def test_close_waits_for_a_callback_still_running():
    """A daemon thread still settling a future when the interpreter exits is unwound
    inside torch's C++ (std::terminate): closing the group waits for it, boundedly."""
    runner = callbacks.Runner("pycoll-test-closing-busy")
    ended = threading.Event()

    def slow():
        time.sleep(0.3)
        ended.set()

    _on_internal(runner, lambda: callbacks.deliver(slow))
    time.sleep(0.05)
    t0 = time.monotonic()
    runner.close()
    assert ended.is_set() and time.monotonic() - t0 < 2
    runner = callbacks.Runner("pycoll-test-closing-stuck")
    stop = threading.Event()
    _on_internal(runner, lambda: callbacks.deliver(stop.wait, 10))
    t0 = time.monotonic()
    runner.close(wait=0.2)      # a callback that does not end does not hold the close for ever
    took = time.monotonic() - t0
    stop.set()
    runner.close()              # (and leaves no thread behind for later tests)
    assert 0.15 < took < 2, took


# -- collectives inside future callbacks --------------------------------------------------
def _collective_in_callback(rank, world):
    t = torch.full((1000,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    state = {}

    def cb(fut):
        state["done_before_callback"] = work.is_completed()
        u = torch.full((7,), float(rank))
        dist.all_reduce(u, async_op=True).get_future().wait()   # PowerSGD's pattern
        v = torch.ones(3)
        dist.all_reduce(v)                                      # and a blocking one
        dist.barrier()
        return torch.cat([u, v])

    out = work.get_future().then(cb).wait()
    # A callback on a future that is already settled runs on this (user) thread.
    again = work.get_future().then(lambda f: f.value()[0].sum().item()).wait()
    return out.tolist(), t[:2].tolist(), again, state["done_before_callback"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_collective_inside_a_then_callback_completes(transport):
    res = run_ranks(_collective_in_callback, 2, backend="pycoll", timeout=60,
                    env={"PYCOLL_TRANSPORT": transport})
    for out, t, again, done_first in res:
        assert out == [1.0] * 7 + [2.0] * 3   # ranks 0 + 1, then the ones summed
        assert t == [3.0, 3.0]
        assert again == 3000.0
        assert done_first is True            # the op is finished before its callbacks run


def _p2p_in_callback(rank, world):
    peer = 1 - rank
    got = torch.zeros(4)
    store = rank_store()
    if rank == 0:       # rank 1's receive is posted first: the progress thread completes it
        store.wait(["posted"])
        work = dist.isend(torch.ones(4), peer)
    else:
        work = dist.irecv(got, peer)
        store.set("posted", "1")

    def cb(fut):
        u = torch.zeros(2)
        if rank == 0:
            dist.isend(torch.full((2,), 5.0), peer).wait()
            dist.recv(u, peer)
        else:
            dist.irecv(u, peer).wait()
            dist.send(u * 2, peer)
        return u

    out = work.get_future().then(cb).wait()
    return out.tolist(), got.tolist()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_point_to_point_inside_a_future_callback_completes(transport):
    # destroy_process_group (the harness's) must not hang afterwards either.
    res = run_ranks(_p2p_in_callback, 2, backend="pycoll", timeout=60, env={"PYCOLL_TRANSPORT": transport})
    assert res[0] == ([10.0, 10.0], [0.0] * 4)
    assert res[1] == ([5.0, 5.0], [1.0] * 4)


# -- torch DDP with the PowerSGD hook, as on gloo --------------------------------------------
def _powersgd(rank, world, backend):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    group = dist.new_group(backend=backend)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model = DDP(m, process_group=group)
    state = P.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                            random_seed=0)
    model.register_comm_hook(state, P.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    _KEEP.append(state)
    return [p.detach().clone() for p in m.parameters()]


# PowerSGD's callbacks hold its state, and the state the group. On gloo the callbacks run on
# the group's worker thread, which can then drop the last reference to the group and so
# join itself in ProcessGroupGloo's destructor: std::terminate ("Resource deadlock
# avoided", 8 of 40 runs here). Keeping the states alive for the life of the rank process
# keeps the comparison run from dying of it; pycoll's callbacks run on a runner thread of
# their own (0 of 40 without this).
_KEEP: list = []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_torch_ddp_with_powersgd_matches_gloo(transport):
    env = {"PYCOLL_TRANSPORT": transport}
    ours = run_ranks(_powersgd, 2, "pycoll", backend="pycoll", timeout=90, env=env)
    gloo = run_ranks(_powersgd, 2, "gloo", backend="pycoll", timeout=90, env=env)
    for a, b in zip(ours, gloo):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


# -- a peer dies under DDP: the survivor raises, never crashes -------------------------------
def _die_under_ddp(rank, world, which):
    torch.set_num_threads(1)
    model = nn.Linear(500, 500)
    if which == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        from ddp import DistributedDataParallel as DDP
    model = DDP(model)
    for step in range(40):
        if rank == 1 and step == 3:
            os._exit(1)
        try:
            model(torch.randn(4, 500)).sum().backward()
        except Exception as exc:  # noqa: BLE001 - the survivor's error is the result
            return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("which", ["torch", "ours"])
def test_peer_death_under_ddp_raises_on_the_survivor(which, transport):
    res = run_ranks(_die_under_ddp, 2, which, backend="pycoll", timeout=60, may_die=(1,),
                    env={"PYCOLL_TRANSPORT": transport})
    assert res[1] == "died"
    assert "rank 1" in res[0] and "no error" not in res[0], res[0]
