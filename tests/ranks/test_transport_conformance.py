"""Every transport passes the one conformance kit (pycoll/testing/conformance.py).

The kit's checks run on the in-memory transport (buffered and lockstep), on TCP over
loopback (real sockets, the mesh built by ``build_mesh`` through a real TCPStore) and on the
shared-memory transport (a real arena, with 4 KiB mailboxes so that frames wrap and large
ones go in pieces). Peer death runs on pooled rank processes for TCP and shared memory.
Then what only some transports have: the lockstep mode reports deadlocks that buffering
hides, and every algorithm's schedule runs through the real executor over lockstep memory,
shared memory and TCP, checked against the whole-world reference of test_algorithms.
"""

from __future__ import annotations

import time

import pytest

from pycoll.algorithms import ALGORITHMS
from pycoll.errors import CommTimeoutError
from pycoll.testing.memory import DeadlockError, MemoryHub
from pycoll.testing import reference as algos
from pycoll.testing import conformance as kit
from pycoll.testing import worlds

pytestmark = pytest.mark.timeout(120)

MAKERS = {"memory": worlds.memory_world, "lockstep": worlds.lockstep_world, "tcp": worlds.tcp_world,
          "tcp-spinning": worlds.tcp_spinning_world, "shm": worlds.shm_world}
CHECKS = {
    "ordering_one_way": kit.check_ordering_one_way,
    "ordering_all_pairs": kit.check_ordering_all_pairs,
    "deadline": kit.check_deadline,
    "abort": kit.check_abort,
    "sever": kit.check_sever,
    "close": kit.check_close,
    "exchange_after_close": kit.check_exchange_after_close,
}
# What the kit found and the owner of the transport has yet to fix (strict: a fix must
# remove the mark).
KNOWN: dict = {}   # (transport, check) -> why it fails today: a strict xfail until fixed


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("transport", list(MAKERS))
def test_conformance(transport, check, request):
    if (transport, check) in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[(transport, check)], strict=True,
                                              raises=(AssertionError, KeyError)))
    with worlds.no_leaks():
        CHECKS[check](MAKERS[transport])


def test_ordering_across_a_one_kib_mailbox_and_five_ranks():
    """The smallest shared-memory mailbox: a header and its payload wrap nearly every time."""
    kit.check_ordering_all_pairs(lambda world: worlds.shm_world(world, mailbox=1024), world=5)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_peer_killed_with_sigkill(transport):
    kit.check_peer_death(transport)   # (and each survivor's closed transport maps nothing)


# -- lockstep: deadlocks reported, not waited out ------------------------------------------

def _send_then_receive(t):
    """Send in one exchange, receive in the next: works only where sends are buffered."""
    peer = 1 - t.rank
    t.exchange([worlds.out_frame(peer, 0, b"hello")], [], time.monotonic() + 10, "send first")
    f, dest = worlds.in_frame(peer, 0, 5)
    t.exchange([], [f], time.monotonic() + 10, "then receive")
    return bytes(dest)


def test_lockstep_reports_a_schedule_that_needs_buffering():
    with worlds.lockstep_world(2) as w:
        t0 = time.monotonic()
        res = worlds.run_threads([lambda t=t: _send_then_receive(t) for t in w.transports], timeout=30)
        took = time.monotonic() - t0
    assert all(isinstance(r, DeadlockError) for r in res), res
    assert took < 2.0, f"the deadlock took {took:.2f} s to report (deadline 10 s)"
    text = str(res[0])
    assert "rank 0" in text and "rank 1" in text and "lockstep" in text, text
    assert isinstance(res[0], CommTimeoutError) and res[0].peer == 1 and res[1].peer == 0
    with worlds.memory_world(2) as w:   # buffered, the same schedule completes
        assert worlds.ok(worlds.run_threads([lambda t=t: _send_then_receive(t) for t in w.transports])) == [b"hello"] * 2


def test_a_cycle_of_receives_is_reported_in_both_modes():
    for lockstep in (False, True):
        with worlds.memory_world(3, lockstep=lockstep) as w:
            res = worlds.run_threads([lambda r=r: kit.wait_for(w.transports[r], (r + 1) % 3, "cycle")
                                   for r in range(3)], timeout=30)
        for r, (exc, took) in enumerate(res):
            assert isinstance(exc, DeadlockError) and exc.peer == (r + 1) % 3, exc
            assert took < 2.0, took


def test_no_deadlock_is_claimed_while_a_rank_is_outside_an_exchange():
    """Rank 1 is busy elsewhere (it may yet send): rank 0's wait ends at its deadline."""
    hub = MemoryHub(2, lockstep=True)
    exc, took = kit.wait_for(hub.transports()[0], 1, "wait", timeout=0.3)
    assert type(exc) is CommTimeoutError and took >= 0.3, (exc, took)


# -- every schedule through the executor, on every transport -------------------------------

class _Hub:
    """Stands in for MemoryHub in test_algorithms.execute: the world's transports from a
    maker, closed when the test ends."""

    maker = None
    open: list = []

    def __init__(self, world: int) -> None:
        self.cm = self.maker(world)
        self.world = self.cm.__enter__()
        _Hub.open.append(self.cm)

    def transports(self):
        return self.world.transports


@pytest.fixture
def executor_on(monkeypatch):
    def use(maker):
        hub = type("Hub", (_Hub,), {"maker": staticmethod(maker)})
        monkeypatch.setattr(algos, "MemoryHub", hub)
    yield use
    while _Hub.open:
        _Hub.open.pop().__exit__(None, None, None)


ALL = [(c, a) for c, names in ALGORITHMS.items() for a in names if c != "barrier"]


@pytest.mark.parametrize("collective,algo", ALL)
def test_every_schedule_runs_in_lockstep(executor_on, collective, algo):
    """No algorithm relies on the medium buffering its sends."""
    executor_on(worlds.lockstep_world)
    for world in (2, 3, 4, 5, 8):
        for n in (0, 13):
            roots = [0, world - 1] if collective in algos.ROOTED else [0]
            for root in roots:
                algos.run_case(collective, algo, world, algos.counts_arg(collective, world, n), root=root,
                               seed=n)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("collective,algo", ALL)
def test_every_schedule_runs_over(executor_on, transport, collective, algo):
    """The executor runs any schedule over shared memory and TCP: 3 ranks, 3001 floats
    in 4 KiB segments, so frames outgrow the 4 KiB mailboxes."""
    executor_on(MAKERS[transport])
    algos.run_case(collective, algo, 3, algos.counts_arg(collective, 3, 3001), root=2, seg=4096)
