"""Lifecycle: init/destroy cycles leave nothing behind, with or without a failure in between.

20 init_process_group / collectives / destroy_process_group cycles in one process (every
fourth one after a collective mismatch that broke the group, every fourth after a
shutdown with abort) must leave the fd count, the pycoll threads and RSS flat, and a new
group must work after each. Each cycle uses its own store prefix, as a fresh torchrun
rendezvous would.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import rank_store, run_ranks

pytestmark = pytest.mark.timeout(120)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _state():
    return (len(os.listdir("/proc/self/fd")),
            sorted(t.name for t in threading.enumerate() if t.name.startswith("pycoll")), _rss_mb())


def _cycles(rank, world, n):
    base = rank_store()
    samples = []
    for i in range(n):
        store = dist.PrefixStore(f"cycle{i}", base)
        dist.init_process_group("pycoll", rank=rank, world_size=world, store=store,
                                timeout=timedelta(seconds=20))
        t = torch.full((1 << 16,), float(rank + 1))
        dist.all_reduce(t)
        assert t.eq(world * (world + 1) / 2).all()
        dist.broadcast(t, 0)
        dist.barrier()
        if i % 4 == 1:  # a broken group: mismatch, then destroy
            try:
                dist.all_reduce(torch.ones(3 + rank))
            except Exception as exc:  # noqa: BLE001
                assert "mismatch" in str(exc), exc
            else:
                raise AssertionError("mismatch not detected")
        if i % 4 == 3:  # shutdown with abort before destroy
            dist.distributed_c10d._get_default_group().abort()
        dist.destroy_process_group()
        samples.append(_state())
    return samples


def test_twenty_init_destroy_cycles_leave_nothing_behind():
    res = run_ranks(_cycles, 2, 20, timeout=100, env={"PYCOLL_TRANSPORT": "tcp"})
    for r, samples in enumerate(res):
        fds = [s[0] for s in samples]
        threads = [s[1] for s in samples]
        rss = [s[2] for s in samples]
        assert fds[-1] <= fds[1], (r, fds)
        assert all(t == [] for t in threads), (r, threads)
        assert rss[-1] - rss[1] < 20, (r, [round(x, 1) for x in rss])
        print(f"\nrank {r}: fds {fds[1]} -> {fds[-1]}, pycoll threads {len(threads[-1])}, "
              f"RSS {rss[1]:.1f} -> {rss[-1]:.1f} MiB")
