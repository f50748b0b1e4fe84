"""The tools' and the CLI's launcher (``pycoll.testing.spawn``): values by rank, the Store on a
port the OS picks, the environment from the start, a failing or dying rank failing the run at
once with its reason (unless the caller said it may die), every process gone afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pycoll.testing import spawn

pytestmark = pytest.mark.timeout(120)


def _hello(rank, world, port, word):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    store.add("arrived", 1)
    while store.add("arrived", 0) < world:     # every rank reaches the Store it was given
        time.sleep(0.01)
    return f"{word} {rank}/{world} pid {os.getpid()} threads={os.environ.get('OMP_NUM_THREADS')}"


def _fails(rank, world, port):
    if rank == 1:
        raise ValueError("rank 1's own error")
    time.sleep(60)


def _dies(rank, world, port):
    if rank == 0:
        os._exit(7)
    time.sleep(60)


def test_values_come_back_by_rank_with_the_environment_set_from_the_start():
    out = spawn.run(_hello, 3, "hi", env={"OMP_NUM_THREADS": "1"}, timeout=90)
    assert [o.split(" pid")[0] for o in out] == ["hi 0/3", "hi 1/3", "hi 2/3"]
    assert all(o.endswith("threads=1") for o in out)
    assert len({o.split("pid ")[1] for o in out}) == 3


@pytest.mark.parametrize("target, words", [(_fails, "rank 1's own error"), (_dies, "exited with code 7")])
def test_a_failing_or_dying_rank_fails_the_run_at_once(target, words):
    t0 = time.monotonic()
    with pytest.raises(spawn.RankFailed, match=words):
        spawn.run(target, 2, timeout=90)
    assert time.monotonic() - t0 < 45          # not the other rank's 60 s, nor the timeout


def _victim(rank, world, port):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    if rank == 1:
        store.set("dying", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["dying"])     # the Store outlives the dead rank: the survivors still use it
    return store.get("dying").decode()


def test_a_rank_that_may_die_leaves_none_and_the_others_report():
    out = spawn.run(_victim, 3, may_die={1}, timeout=90)
    assert out == ["1", None, "1"]
    with pytest.raises(spawn.RankFailed, match="rank 1 of 3 exited with code -9"):
        spawn.run(_victim, 3, may_die={2}, timeout=90)
