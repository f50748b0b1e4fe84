"""pycoll.transport.waits: the one-shot hook a collective's waiting thread runs when a peer is late.

``pycoll.partial`` sends its activations from it; here it is checked on its own: the pure
bookkeeping, then real ranks over TCP and shared memory.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from pycoll.transport import waits as slow_wait
from pycoll.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(60)


def test_due_runs_the_hook_once_and_only_inside_the_context():
    calls = []
    assert slow_wait.due(time.monotonic()) == math.inf           # no hook
    with slow_wait.OnSlow(10.0, lambda: calls.append(1)):
        left = slow_wait.due(time.monotonic())
        assert 9.0 < left <= 10.0 and calls == []                 # not yet due: how long to wait
        assert slow_wait.due(time.monotonic() + 11) == math.inf and calls == [1]
        assert slow_wait.due(time.monotonic() + 12) == math.inf and calls == [1]   # once
    with slow_wait.OnSlow(0.0, lambda: calls.append(2)):
        pass
    assert slow_wait.due(time.monotonic() + 1) == math.inf and calls == [1]      # cleared on exit


def _late_peer(rank, world, late_s):
    t = torch.ones(1000)
    fired: list[float] = []
    if rank == 1:
        time.sleep(late_s)
    t0 = time.monotonic()
    with slow_wait.OnSlow(0.05, lambda: fired.append(time.monotonic() - t0)):
        dist.all_reduce(t)
    dist.barrier()
    prompt: list[int] = []
    with slow_wait.OnSlow(5.0, lambda: prompt.append(1)):
        dist.all_reduce(t)
    return fired, prompt, t[0].item()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_waiting_rank_runs_the_hook_once_on_time_and_a_prompt_one_never(transport):
    (f0, p0, v0), (f1, p1, _) = run_ranks(_late_peer, 2, 0.5, backend="pycoll", timeout=30,
                                          env={"PYCOLL_TRANSPORT": transport})
    assert len(f0) == 1 and 0.04 <= f0[0] < 0.4, f0   # rank 0 waited 0.5 s for rank 1
    assert f1 == []                                    # rank 1 found rank 0 waiting
    assert p0 == [] and p1 == []                       # nobody late: never runs
    assert v0 == 4.0                                   # and the results are right
