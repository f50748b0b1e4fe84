"""A dead rank without a restart: the survivors shrink the group and go on (multi-process).

A rank is SIGKILLed between collectives or inside one (``PYCOLL_FAULT`` kill_at_step, which
fires on shared memory, TCP and the hierarchical path alike); the survivors get the error
naming it, call ``dist.shrink_group`` (or ``pycoll.shrink``), and the new group works with
contiguous ranks, on the default group and on a subgroup, twice in a row. Nothing of the
old groups is left (fds, threads). The Store is the test's own, as torchrun's agent's is.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import run_ranks

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

PATHS = {"shm": {"PYCOLL_TRANSPORT": "shm"},
         "tcp": {"PYCOLL_TRANSPORT": "tcp"},
         "hierarchical": {"PYCOLL_TRANSPORT": "hierarchical", "PYCOLL_HOST_ID": "a,a,b,b"}}


def _fail_then_shrink(dead: int, how: str, group=None, flags: int = 0):
    """Run all_reduces until one fails; shrink. Returns (error text, new group, seconds)."""
    import pycoll

    err = None
    for _ in range(200):
        try:
            dist.all_reduce(torch.ones(4096), group=group)
        except Exception as exc:  # noqa: BLE001 - the error is what the test reads
            err = f"{type(exc).__name__}: {exc}"
            break
        time.sleep(0.001)
    t0 = time.monotonic()
    if how == "torch":
        new = dist.shrink_group([dead], group=group, shrink_flags=flags)
    else:
        new = pycoll.shrink(group, exclude=[dead], flags=flags)
    return err, new, t0


def _survive(rank, world, how, dead, sub, flags, kill_inside):
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world))) if sub else None
    dist.all_reduce(torch.ones(8), group=group)
    if rank == dead and not kill_inside:
        os._exit(1)
    err, new, t0 = _fail_then_shrink(dead, how, group, flags)
    t = torch.full((3,), float(new.rank()))
    dist.all_reduce(t, group=new)
    took = time.monotonic() - t0
    default_is_new = dist.distributed_c10d._get_default_group() is new
    return err, new.rank(), new.size(), t.tolist(), took, default_is_new, new.name()


def _check(res, world, dead, sub=False):
    assert res[dead] == "died"
    n = world - 1
    total = float(sum(range(n)))
    for old, r in enumerate(res):
        if old == dead:
            continue
        err, rank, size, values, took, default_is_new, name = r
        assert err is not None and f"rank {dead}" in err, err
        assert (rank, size) == (old - (old > dead), n), r
        assert values == [total] * 3, r
        assert default_is_new is (not sub)
        assert name == "pycoll"
    return max(r[4] for i, r in enumerate(res) if i != dead)


@pytest.mark.parametrize("path", PATHS)
def test_survivors_shrink_the_default_group_and_go_on(path):
    res = run_ranks(_survive, 4, "torch", 1, False, 0, False, backend="pycoll", timeout=90,
                    may_die=(1,), env=PATHS[path])
    _check(res, 4, 1)


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_killed_inside_a_collective_is_shrunk_away(path):
    env = dict(PATHS[path], PYCOLL_FAULT="rank=2:op=all_reduce:seq=3:kill_at_step=1")
    res = run_ranks(_survive, 4, "torch", 2, False, 0, True, backend="pycoll", timeout=90,
                    may_die=(2,), env=env)
    _check(res, 4, 2)


def test_a_subgroup_shrinks_with_abort_and_pycoll_shrink_works_without_torchs_helper(monkeypatch):
    res = run_ranks(_survive, 3, "torch", 0, True, 1, False, backend="pycoll", timeout=90,
                    may_die=(0,), env={"PYCOLL_TRANSPORT": "tcp"})
    _check(res, 3, 0, sub=True)
    res = run_ranks(_no_torch_helper, 3, backend="pycoll", timeout=90, may_die=(2,),
                    env={"PYCOLL_TRANSPORT": "shm"})
    _check(res, 3, 2)


def _no_torch_helper(rank, world):
    """pycoll.shrink on a torch without dist.shrink_group (hidden here)."""
    saved = dist.shrink_group
    del dist.shrink_group
    try:
        return _survive(rank, world, "pycoll", 2, False, 0, False)
    finally:
        dist.shrink_group = saved


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _held() -> tuple[set, set]:
    """What this process holds: its descriptors' targets and its live threads."""
    import gc

    gc.collect()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return fds, set(threading.enumerate())


def _kept_from_earlier(held: list) -> list:
    """Descriptors and threads a generation added that a later generation still holds
    (once a group is shrunk away, nothing of it may stay)."""
    kept = []
    for k in range(1, len(held) - 1):
        added = (held[k][0] - held[k - 1][0], held[k][1] - held[k - 1][1])
        kept += [str(x) for x in added[0] & held[-1][0]] + [x.name for x in added[1] & held[-1][1]]
    return kept


def _twice(rank, world):
    torch.set_num_threads(1)
    seen = []
    dist.all_reduce(torch.ones(8))
    base = (_fds(), threading.active_count())
    held = [_held()]
    for dead in (3, 2):      # rank 3 dies, then the shrunk group's rank 2
        if dist.get_rank() == dead:
            os._exit(1)
        err, new, _ = _fail_then_shrink(dead, "torch")
        t = torch.ones(5)
        dist.all_reduce(t)
        seen.append((dist.get_world_size(), t[0].item(), "rank %d" % dead in err))
        held.append(_held())
    return seen, base, (_fds(), threading.active_count()), _kept_from_earlier(held)


def test_two_failures_two_shrinks_nothing_left_of_the_old_groups():
    res = run_ranks(_twice, 4, backend="pycoll", timeout=90, may_die=(2, 3))
    for r in (0, 1):
        seen, (fd0, th0), (fd1, th1), kept = res[r]
        assert seen == [(3, 3.0, True), (2, 2.0, True)], seen
        assert fd1 <= fd0 and th1 <= th0, res[r]
        assert not kept, kept


def _excluded_rank_calls(rank, world):
    try:
        dist.shrink_group([rank])
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "no error"


def test_bad_shrinks_are_refused_before_any_communication():
    from pycoll.c10d.shrink import remaining_ranks

    assert remaining_ranks(4, [1, 1, 3]) == [0, 2]
    for bad, text in (([4], "not ranks"), ([], "no rank"), ([0, 1], "every rank")):
        with pytest.raises(ValueError, match=text):
            remaining_ranks(2, bad)
    res = run_ranks(_excluded_rank_calls, 2, backend="pycoll", timeout=60)
    assert all("excluded" in r[1] for r in res), res


def _dies_during_the_shrink(rank, world, delay):
    torch.set_num_threads(1)
    dist.all_reduce(torch.ones(8))
    if rank == 3:
        os._exit(1)
    err = None
    while err is None:
        try:
            dist.all_reduce(torch.ones(8))
        except Exception as exc:  # noqa: BLE001
            err = str(exc)
    if rank == 2:                  # a survivor that dies once the others are inside the shrink
        time.sleep(delay)
        os._exit(1)
    t0 = time.monotonic()
    try:
        dist.shrink_group([3])
        return "shrink did not fail"
    except Exception as exc:  # noqa: BLE001 - the error is the result
        failed = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    new = dist.shrink_group([2, 3])       # retried without the second dead rank
    t = torch.ones(4)
    dist.all_reduce(t, group=new)
    return failed, new.size(), t.tolist()


@pytest.mark.parametrize("path", ["shm", "tcp"])
@pytest.mark.parametrize("delay", [0.0, 0.2])
def test_a_rank_dying_during_the_shrink_fails_it_at_once_and_it_can_be_retried(path, delay):
    res = run_ranks(_dies_during_the_shrink, 4, delay, backend="pycoll", timeout=90, may_die=(2, 3),
                    env=PATHS[path])
    for r in (0, 1):
        (text, seconds), size, values = res[r]
        assert "rank 2" in text and "died during the shrink" in text, text
        assert seconds < delay + 10, (seconds, text)      # not the init deadline (90 s here)
        assert (size, values) == (2, [2.0] * 4)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _eight_generations(rank, world):
    """Each generation the highest rank dies and the rest shrink: 9 ranks, 8 shrinks."""
    torch.set_num_threads(1)
    dist.all_reduce(torch.ones(1 << 14))
    seen = []
    base = None
    held = [_held()]
    for _ in range(world - 1):
        last = dist.get_world_size() - 1
        if dist.get_rank() == last:
            os._exit(1)
        _err, _new, _ = _fail_then_shrink(last, "torch")
        t = torch.ones(1 << 14)
        dist.all_reduce(t)
        seen.append(int(t[0].item()))
        held.append(_held())
        if base is None:    # after the first shrink: what one generation keeps for good
            base = (_fds(), threading.active_count(), _rss_kib())
    return seen, base, (_fds(), threading.active_count(), _rss_kib()), _kept_from_earlier(held)


def test_eight_generations_leave_no_fds_threads_or_memory_behind():
    res = run_ranks(_eight_generations, 9, backend="pycoll", timeout=110, may_die=tuple(range(1, 9)))
    seen, (fd0, th0, rss0), (fd1, th1, rss1), kept = res[0]
    assert seen == list(range(8, 0, -1)), seen
    assert not kept, kept
    assert fd1 <= fd0 and th1 <= th0, res[0]
    assert rss1 - rss0 < 5 * 1024, f"RSS grew by {(rss1 - rss0) / 1024:.1f} MiB over 7 shrinks"
    print(f"\n  8 generations: fds {fd0} -> {fd1}, threads {th0} -> {th1}, RSS {rss0 / 1024:.1f} -> "
          f"{rss1 / 1024:.1f} MiB")


@pytest.mark.timeout(240)
def test_the_survival_recipe_trains_to_the_end_as_a_3_rank_run_would():
    """tools/survive.py: torch DDP and ddp/ on 4 ranks, one SIGKILLed, the rest shrink and
    finish; their model equals a 3-rank run resumed from their state at the kill."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "survive.py"), "--steps", "10",
                          "--kill-step", "4", "--no-torchrun", "--json"], capture_output=True, text=True,
                         timeout=220, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout)
    assert [r["ddp"] for r in reports] == ["torch", "ours"]
    for r in reports:
        assert r["world_after"] == 3 and f"rank {r['victim']}" in r["error"], r
        assert r["max_diff_vs_3_rank_run"] == 0.0, r
        assert r["kill_to_first_step_s"] < 10, r


def _outstanding_works_end(rank, world, flags):
    torch.set_num_threads(1)
    dist.all_reduce(torch.ones(8))
    if rank == 2:
        os._exit(1)
    works = [dist.all_reduce(torch.ones(1 << 16), async_op=True) for _ in range(6)]
    new = dist.shrink_group([2], shrink_flags=flags)
    ends = []
    for w in works:
        try:
            w.wait()
            ends.append("completed")
        except Exception as exc:  # noqa: BLE001 - the error is the result
            ends.append(type(exc).__name__)
    t = torch.ones(2)
    dist.all_reduce(t, group=new)
    return ends, t.tolist()


@pytest.mark.parametrize("flags", [0, 1])
def test_the_failed_groups_outstanding_works_all_end_with_the_error(flags):
    res = run_ranks(_outstanding_works_end, 3, flags, backend="pycoll", timeout=60, may_die=(2,))
    for ends, values in res[:2]:
        assert "completed" not in ends and len(ends) == 6, ends
        assert values == [2.0, 2.0]
