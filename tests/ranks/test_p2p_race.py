"""A receive posted while its large message is still arriving must take that message.

Regression: the point-to-point engine reads a frame nobody has asked for into a buffer of
its own; a receive posted during that read used to wait for a second message forever.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import run_ranks


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


def _in_order(rank, world):
    sizes = [4 << 20, 3, 1 << 20, 5, 7]   # a send the socket takes only in part, then small ones
    if rank == 0:
        works = [dist.isend(torch.full((n,), float(i)), 1, tag=7) for i, n in enumerate(sizes)]
        for w in works:
            w.wait()
        return None
    got = []
    for n in sizes:
        t = torch.empty(n)
        dist.recv(t, 0, tag=7)
        got.append(sorted(set(t.tolist())))
    return got


@pytest.mark.timeout(60)
def test_sends_to_one_peer_arrive_in_posting_order():
    # The caller sends at once only when nothing is queued to that peer: a small message
    # must never overtake a large one the socket has taken only in part.
    res = run_ranks(_in_order, 2, backend="pycoll", timeout=50)
    assert res[1] == [[0.0], [1.0], [2.0], [3.0], [4.0]], res
