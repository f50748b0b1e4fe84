"""torch's reconfigure API on pycoll groups (torch >= 2.14): shrink after a death, a new process
joining, a split merging back, recovery after abort, bad handles and reused uuids; on an
older torch, a clear error.

Ranks meet as torch's users do: each publishes ``dist._get_reconfigure_handle()`` in the
Store and every member reconfigures with the same uuid and handles.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll import torch_compat
from pycoll.testing.ranks import run_ranks
from tests.support import reconfigure as rc

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]
needs_api = pytest.mark.skipif(not torch_compat.reconfigure_supported(),
                               reason="torch < 2.14 has no reconfigure API")
PATHS = {"shm": {"PYCOLL_TRANSPORT": "shm"}, "tcp": {"PYCOLL_TRANSPORT": "tcp"},
         "hierarchical": {"PYCOLL_TRANSPORT": "hierarchical", "PYCOLL_HOST_ID": "a,a,b,b"}}


def _heal(rank, world):
    """Processes 0-2 form a group of 3, process 2 dies, 0-1 shrink, process 3 joins."""
    torch.set_num_threads(1)
    me = {"process": rank}
    store = rc.init(rank, 3 if rank < 3 else 4, enable_reconfigure=True)
    if rank == 3:                                  # the joiner: waits for the survivors' call
        store.wait(["grow"])
    else:
        try:
            rc.total()
        except Exception as exc:  # noqa: BLE001 - the result
            me["before"] = str(exc)
        dist._reconfigure(1, rc.meet(store, "first", rank, [0, 1, 2]))
        me["first"] = (dist.get_rank(), dist.get_world_size(), rc.total())
        if rank == 2:
            os._exit(1)
        try:
            while True:
                rc.total()
        except Exception as exc:  # noqa: BLE001
            me["error"] = type(exc).__name__
        dist._reconfigure(2, rc.meet(store, "shrink", rank, [0, 1]))
        me["shrunk"] = (dist.get_rank(), dist.get_world_size(), rc.total())
        store.set("grow", "1")
    # Grow: a set of handles: the survivors keep their order, the joiner comes last.
    handles = set(rc.meet(store, "grow", rank, [0, 1, 3]))
    dist._reconfigure(3, handles)
    me["grown"] = (dist.get_rank(), dist.get_world_size(), torch_compat.default_group().size(), rc.total())
    state = torch.arange(6.0) if dist.get_rank() == 0 else torch.zeros(6)
    dist.broadcast(state, 0)                       # a survivor's state, to the joiner
    me["state"] = state.tolist()
    try:
        dist._reconfigure(3, set(rc.meet(store, "again", rank, [0, 1, 3])))
    except Exception as exc:  # noqa: BLE001
        me["reused"] = str(exc)
    dist._reconfigure(4, rc.meet(store, "again2", rank, [0, 1, 3]))
    sub = dist.new_group([0, 1])
    me["sub"] = rc.total(sub) if dist.get_rank() < 2 else None
    model = torch.nn.Linear(4, 2)
    torch.manual_seed(dist.get_rank())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(3, 4)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(grads) for _ in range(3)]
    dist.all_gather(gathered, grads)
    me["ddp_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
    from ddp import DistributedDataParallel as OurDDP

    model = torch.nn.Linear(4, 2)
    ours = OurDDP(model)                           # ours, wrapped on the reconfigured group
    ours(torch.randn(3, 4)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_gather(gathered, grads)
    me["ours_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
    dist.destroy_process_group()
    return me


@needs_api
@pytest.mark.parametrize("path", ["shm", "tcp", "hierarchical"])
def test_shrink_after_a_death_then_a_new_process_joins(path):
    res = run_ranks(_heal, 4, timeout=150, env=PATHS[path], may_die=(2,))
    assert res[2] == "died"
    for process in (0, 1):
        r = res[process]
        assert "enable_reconfigure=True" in r["before"]
        assert r["first"] == (process, 3, 6.0) and r["shrunk"] == (process, 2, 3.0)
    for process, rank in ((0, 0), (1, 1), (3, 2)):
        r = res[process]
        assert r["grown"] == (rank, 3, 3, 6.0), r
        assert r["state"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert "uuid 3 was already used" in r["reused"], r["reused"]
        assert r["sub"] == (3.0 if rank < 2 else None)
        assert r["ddp_equal"] and r["ours_equal"]


def _bad(rank, world):
    store = rc.init(rank, world)                   # a group made as usual can be reconfigured too
    mine = dist._get_reconfigure_handle()
    out = {}
    for name, handles in (("empty", []), ("garbled", [mine, "pycoll1:x"]), ("foreign", [mine, "gloo:0:-1:0:"]),
                          ("duplicate", [mine, mine]), ("not mine", [mine.replace(":-1:", ":7:")])):
        out[name], _ = rc.outcome(10, handles)
    out["still works"] = rc.total()   # refused before any I/O: the group is intact
    handles = rc.meet(store, "h", rank, list(range(world)))
    if rank == 1:
        handles = handles[::-1]                  # a different list on one rank
    out["differ"], out["differ_s"] = rc.outcome(11, handles, timeout=timedelta(seconds=20))
    dist._reconfigure(12, rc.meet(store, "h2", rank, list(range(world))))
    out["recovered"] = rc.total()
    dist.destroy_process_group()
    return out


@needs_api
def test_bad_handles_are_refused_before_any_io_and_differing_lists_fail_every_rank():
    res = run_ranks(_bad, 3, timeout=120)
    for r in res:
        assert "no handles" in r["empty"]
        assert "garbled" in r["garbled"] or "not a pycoll handle" in r["garbled"]
        assert "not a pycoll handle" in r["foreign"]
        assert "not unique" in r["duplicate"]
        assert "not among the handles" in r["not mine"]
        assert r["still works"] == 6.0
        assert "different handles for uuid 11" in r["differ"], r["differ"]
        assert r["differ_s"] < 15
        assert r["recovered"] == 6.0


def _abort_and_recover(rank, world):
    store = rc.init(rank, world)
    ran = []
    pg = torch_compat.default_group()
    pg.register_abort_hook(1, lambda: ran.append("hook 1"))
    pg.register_abort_hook(2, lambda: ran.append("hook 2"))
    pg.unregister_abort_hook(2)
    before = str(pg.get_error())
    pg.abort()
    try:
        rc.total()
        after = "no error"
    except Exception as exc:  # noqa: BLE001
        after = type(exc).__name__
    dist._reconfigure(1, rc.meet(store, "h", rank, list(range(world))))
    total, error = rc.total(), str(pg.get_error())
    dist.destroy_process_group()
    return ran, before, after, total, error


@needs_api
def test_abort_runs_the_hooks_and_a_reconfigure_recovers():
    for ran, before, after, total, error in run_ranks(_abort_and_recover, 2, timeout=90):
        assert ran == ["hook 1"] and "SUCCESS" in before and after != "no error"
        assert total == 3.0 and "SUCCESS" in error


def _split_and_merge(rank, world):
    store = rc.init(rank, world)
    half = [0, 1] if rank < 2 else [2, 3]
    dist._reconfigure(100 + half[0], rc.meet(store, f"half{half[0]}", rank, half))
    split = (dist.get_rank(), dist.get_world_size(), rc.total())
    merged = set(rc.meet(store, "merge", rank, list(range(world))))
    dist._reconfigure(200, merged)
    merged = (dist.get_rank(), dist.get_world_size(), rc.total())
    dist.destroy_process_group()
    return split, merged


@needs_api
def test_split_halves_merge_back_in_their_old_order():
    res = run_ranks(_split_and_merge, 4, timeout=90)
    assert res == [((r % 2, 2, 3.0), (r, 4, 10.0)) for r in range(4)]


def _old_torch(rank, world):
    rc.init(rank, world)
    pg = torch_compat.default_group()
    try:
        pg.get_reconfigure_handle()
        return pg.supports_reconfigure, "no error"
    except Exception as exc:  # noqa: BLE001
        return pg.supports_reconfigure, f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch_compat.reconfigure_supported(), reason="this torch has the API")
def test_an_older_torch_says_reconfigure_needs_a_newer_one():
    for supported, error in run_ranks(_old_torch, 2, timeout=60):
        assert supported is False and "needs torch >= 2.14" in error, error
