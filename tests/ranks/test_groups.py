"""Subgroups of the pycoll backend: names, destruction, re-creation, under either default backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import run_ranks


def _subgroup_cycles(rank, world):
    out = []
    for i in range(3):
        g = dist.new_group(backend="pycoll")
        t = torch.ones(3) * (rank + i)
        dist.all_reduce(t, group=g)
        out.append((g.group_name != "", t[0].item()))
        dist.destroy_process_group(g)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("default", ["gloo", "pycoll"])
def test_pycoll_subgroups_are_named_and_destroyed(default):
    res = run_ranks(_subgroup_cycles, 2, backend=default)
    for r in res:
        assert r == [(True, 1.0), (True, 3.0), (True, 5.0)], res
