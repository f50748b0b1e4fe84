"""Inputs that used to hang a group, break it or corrupt results silently (multi-process).

Everything a rank can check alone is checked before any I/O (expanded outputs, split sizes
of its own block), lazy views are resolved (negative and conjugate bits), split sizes the
ranks disagree on are a MismatchError on every transport, a timeout of 30 days works, and a
peer that overflows the unexpected-message bound is told at once instead of timing out.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import rank_store, run_ranks

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ["shm", "tcp"]


def _raises(fn, exc_type, text: str) -> str:
    try:
        fn()
    except exc_type as exc:
        assert text in str(exc), exc
        return type(exc).__name__
    raise AssertionError(f"expected {exc_type.__name__}")


def _rejected_before_io(rank, world):
    expanded = torch.ones(1).expand(4)
    _raises(lambda: dist.all_reduce(expanded), ValueError, "share memory")
    _raises(lambda: dist.broadcast(expanded, 0), ValueError, "share memory")
    _raises(lambda: dist.all_gather_into_tensor(torch.zeros(1).expand(2 * world), torch.ones(2)),
            ValueError, "share memory")
    _raises(lambda: dist.all_gather([torch.zeros(1).expand(3)] * world, torch.ones(3)), ValueError,
            "share memory")
    peer = 1 - rank
    if rank == 1:
        _raises(lambda: dist.irecv(torch.zeros(1).expand(4), peer), ValueError, "share memory")
    # Own-block split sizes that cannot agree with themselves.
    _raises(lambda: dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [2, 2], [1, 3] if rank else [3, 1]),
            ValueError, "to itself")
    # Nothing communicated, nothing broken: the group and point-to-point still work.
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    got = torch.zeros(4)
    if rank == 0:
        dist.send(torch.arange(4.0), peer)
    else:
        dist.recv(got, peer)
    # An expanded *input* is only read: fine.
    if rank == 0:
        dist.send(torch.ones(1).expand(4), peer)
    else:
        dist.recv(got, peer)
    return t.tolist(), got.tolist()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_what_a_rank_can_check_alone_fails_before_any_io(transport):
    res = run_ranks(_rejected_before_io, 2, backend="pycoll", env={"PYCOLL_TRANSPORT": transport})
    assert res[0] == ([3.0] * 3, [0.0] * 4)
    assert res[1] == ([3.0] * 3, [1.0] * 4)


def _lazy_views(rank, world):
    base = torch.arange(4.0) + rank
    neg = torch._neg_view(base)
    dist.all_reduce(neg)                      # in place into a negative view
    nb = torch._neg_view(torch.arange(3.0) + 10 * rank)
    dist.broadcast(nb, 0)
    gathered = torch.zeros(2 * world)
    dist.all_gather_into_tensor(gathered, torch._neg_view(torch.full((2,), float(rank + 1))))
    pg = dist.distributed_c10d._get_default_group()
    c = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
    cv = c.conj()                             # torch's wrapper refuses these; the group resolves them
    pg.allreduce([cv]).wait()
    return neg.tolist(), nb.tolist(), gathered.tolist(), cv.tolist()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_negative_and_conjugate_views_give_their_values(transport):
    res = run_ranks(_lazy_views, 2, backend="pycoll", env={"PYCOLL_TRANSPORT": transport})
    for neg, nb, gathered, cv in res:
        assert neg == [-1.0, -3.0, -5.0, -7.0]          # -(0+1), -(1+2), ...
        assert nb == [-0.0, -1.0, -2.0]
        assert gathered == [-1.0, -1.0, -2.0, -2.0]
        assert cv == [3 - 6j, 9 + 3j]                    # conj(1+2j)*3, conj(3-1j)*3


def _disagreeing_splits(rank, world):
    out = torch.zeros(4)
    dist.all_to_all_single(out, torch.arange(4.0) + 10 * rank)   # a good one first: stale data exists
    splits = [2, 2] if rank == 0 else [3, 1]       # rank 1 sends 3 where rank 0 expects 2
    try:
        dist.all_to_all_single(torch.full((4,), -1.0), torch.arange(4.0), splits, splits)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_split_sizes_the_ranks_disagree_on_are_a_mismatch(transport):
    res = run_ranks(_disagreeing_splits, 2, backend="pycoll", env={"PYCOLL_TRANSPORT": transport})
    for kind, text in res:
        assert kind == "MismatchError" and "split sizes disagree" in text, (kind, text)


def _month_timeout(rank, world):
    dist.init_process_group("pycoll", rank=rank, world_size=world, store=dist.PrefixStore("month", rank_store()),
                            timeout=timedelta(days=30))
    try:
        t = torch.ones(8)
        dist.all_reduce(t)
        peer = 1 - rank
        got = torch.zeros(2)
        if rank == 0:
            dist.isend(torch.ones(2), peer).wait()
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            time.sleep(0.2)                    # the progress thread sleeps with a month's deadline
            dist.send(got * 3, peer)
        dist.barrier()
        return t[0].item(), got.tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_timeout_of_thirty_days_works(transport):
    res = run_ranks(_month_timeout, 2, env={"PYCOLL_TRANSPORT": transport})
    assert res == [(2.0, [3.0, 3.0]), (2.0, [1.0, 1.0])]


def _overflow_unexpected(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    if rank == 1:
        pg.communicator.p2p.max_unexpected = 1 << 10
    dist.barrier()
    t0 = time.monotonic()
    try:
        if rank == 0:
            dist.send(torch.zeros(1 << 24), 1)        # 64 MiB nobody asked for: more than sockets hold
        else:
            time.sleep(0.5)
            dist.recv(torch.zeros(1 << 24), 0)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def test_a_sender_past_the_unexpected_bound_is_told_at_once():
    res = run_ranks(_overflow_unexpected, 2, backend="pycoll", timeout=90)
    for kind, text, seconds in res:
        assert "PYCOLL_MAX_UNEXPECTED_BYTES" in text, (kind, text)
        assert seconds < 10, seconds                  # the group timeout is 60 s
    print(f"\n  past the unexpected bound: sender told after {res[0][2]:.3f} s, receiver raised after "
          f"{res[1][2]:.3f} s (its receive was posted 0.5 s late)")
