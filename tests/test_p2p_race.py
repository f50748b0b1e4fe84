"""A receive posted while its large message is still arriving must take that message.

Regression: the point-to-point engine reads a frame nobody has asked for into a buffer of
its own; a receive posted during that read used to wait for a second message forever.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks


def _late_receive(rank, world, delays_ms):
    ok = []
    for i, delay in enumerate(delays_ms):
        dist.barrier()
        if rank == 0:
            dist.send(torch.full((4 << 20,), float(i)), 1, tag=i)  # 16 MiB: read over several ms
        else:
            time.sleep(delay / 1000)
            t = torch.empty(4 << 20)
            dist.recv(t, 0, tag=i)
            ok.append(bool((t == i).all()))
    return ok


@pytest.mark.timeout(120)
def test_receive_posted_while_its_message_arrives():
    delays = [0.5 * i for i in range(40)]
    res = run_ranks(_late_receive, 2, delays, backend="pycoll", timeout=100,
                    env={"PYCOLL_TRANSPORT": "tcp"})
    assert res[1] == [True] * len(delays), res
