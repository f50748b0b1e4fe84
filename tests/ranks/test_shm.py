"""Shared-memory path: segment lifetime, blocking waits, dead peers, mismatches, many rounds, memory.

Ranks run on the reused pool (pycoll/testing/ranks.py); every group here is on one host, so the
default transport is shared memory. Each test says which path it forces, if any.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import pycoll_memory, rank_store, run_ranks

pytestmark = pytest.mark.timeout(240)


def _segments_after_init(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(10)
    dist.all_reduce(t)
    return pg.communicator.mode, pycoll_memory()


def test_the_segment_has_no_name_and_one_descriptor_per_mapping():
    """Every rank maps the arena and the point-to-point rings, each a memfd: no name in
    /dev/shm for a crash to leave. Each rank holds one descriptor of each, the one Python's
    mmap keeps beside its mapping (the creator closed the descriptor it made once all had
    mapped it), so the memory lives exactly as long as the mappings. (After the group, the
    harness checks that none is left.)"""
    res = run_ranks(_segments_after_init, 3, backend="pycoll")
    assert [r[0] for r in res] == ["shm"] * 3
    for rank, (_, held) in enumerate(res):
        for name in ("arena", "p2p"):
            assert any(h.startswith(f"/memfd:pycoll-{name}") for h in held), (rank, held)
            assert len([h for h in held if h.startswith("fd ") and f"pycoll-{name}" in h]) == 1, (rank, held)
        assert len([h for h in held if h.startswith("fd ")]) == 2, (rank, held)
        assert not [h for h in held if "/dev/shm" in h], (rank, held)


def _barrier_cpu(rank, world):
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    cpu0, wall0 = time.process_time(), time.monotonic()
    dist.barrier()
    return time.process_time() - cpu0, time.monotonic() - wall0


@pytest.mark.parametrize("world", [2, 4])
def test_blocked_barrier_uses_no_cpu(world):
    res = run_ranks(_barrier_cpu, world, backend="pycoll")
    cpu, wall = res[0]
    assert wall > 0.9, res
    assert cpu < 0.05 * wall, f"rank 0 used {cpu:.3f} s of CPU in a {wall:.2f} s barrier"


def _woken_late(rank, world):
    """Rank 0 blocks in a barrier; the last rank arrives later: how long after does rank 0
    leave? Wait slices are 2 s here, so only a futex wake can end rank 0's wait in time."""
    from pycoll.shm import arena as shm
    slice_was, shm.WAIT_SLICE = shm.WAIT_SLICE, 2.0
    try:
        gaps = []
        for _ in range(3):
            dist.barrier()
            if rank == world - 1:
                time.sleep(0.2)
            arrived = time.monotonic()     # CLOCK_MONOTONIC: one clock for the whole host
            dist.barrier()
            gaps.append(time.monotonic() if rank == 0 else arrived)
        return gaps
    finally:
        shm.WAIT_SLICE = slice_was


@pytest.mark.parametrize("world", [2, 3])
def test_a_sleeping_rank_is_woken_when_the_last_one_arrives(world):
    res = run_ranks(_woken_late, world, backend="pycoll")
    gaps = sorted(left - came for left, came in zip(res[0], res[-1]))
    assert gaps[1] < 0.1, f"rank 0 left the barrier {gaps} s after the last rank came"


def _die_in_collective(rank, world, victim, nbytes):
    store = rank_store()
    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)
    if rank == victim:
        def kill():
            time.sleep(0.05)
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()
    try:
        for _ in range(100000):
            dist.all_reduce(t)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        failed_at = time.time()
        killed_at = float(store.get("killed_at"))
        return failed_at - killed_at, f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world,victim", [(2, 1), (3, 0), (4, 2)])
def test_kill9_inside_a_collective(transport, world, victim):
    res = run_ranks(_die_in_collective, world, victim, 1 << 20, backend="pycoll",
                    env={"PYCOLL_TRANSPORT": transport}, may_die=(victim,))
    assert res[victim] == "died"
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        assert r is not None, f"rank {rank} never saw the failure"
        delay, text = r
        assert delay < 2.0, f"rank {rank} raised {delay:.2f} s after the kill: {text}"
        assert f"rank {victim}" in text, f"rank {rank}'s error does not name rank {victim}: {text}"
    # (each survivor's group, destroyed, left no shared memory: the harness checks it)


def _mismatch(rank, world):
    try:
        if rank == 1:
            dist.broadcast(torch.ones(10), src=0)
        else:
            dist.all_reduce(torch.ones(10 + rank))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_mismatch_is_reported_on_every_rank():
    res = run_ranks(_mismatch, 3, backend="pycoll", env={"PYCOLL_TRANSPORT": "shm"})
    for text in res:
        assert "MismatchError" in text and "broadcast" in text and "all_reduce" in text, res


def _many_rounds(rank, world):
    """Every shared-memory collective with 4 KiB slots (many rounds), checked against gloo."""
    gloo = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(rank)
    checks = []

    def both(fn):
        a, b = fn(None), fn(gloo)
        checks.append(all(torch.equal(x, y) for x, y in zip(a, b)))

    n = 5003
    x = torch.randint(-50, 50, (n,), generator=gen, dtype=torch.int64)
    both(lambda g: [_ret(dist.all_reduce, x.clone(), group=g)])
    both(lambda g: [_ret(dist.all_reduce, x.clone(), op=dist.ReduceOp.MAX, group=g)])
    both(lambda g: [_ret(dist.broadcast, x.clone(), src=world - 1, group=g)])
    both(lambda g: [_ret(dist.reduce, x.clone(), dst=1, group=g)[0:(x.numel() if rank == 1 else 0)]])
    both(lambda g: _gathered(x, world, g))
    both(lambda g: _rs(x, world, g))
    both(lambda g: _a2a(rank, world, g))
    both(lambda g: _gather_scatter(rank, world, x, g))
    return checks


def _ret(fn, t, **kw):
    fn(t, **kw)
    return t


def _gathered(x, world, g):
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x, group=g)
    return out


def _rs(x, world, g):
    out = torch.empty(x.numel() // world * 1, dtype=x.dtype)
    inp = x[: out.numel() * world].clone()
    dist.reduce_scatter_tensor(out, inp, group=g)
    return [out]


def _a2a(rank, world, g):
    send = [1000 * (r + 1) + 7 * rank for r in range(world)]
    recv = [1000 * (rank + 1) + 7 * r for r in range(world)]
    inp = torch.arange(sum(send), dtype=torch.float64) + rank * 1e6
    out = torch.empty(sum(recv), dtype=torch.float64)
    dist.all_to_all_single(out, inp, recv, send, group=g)
    return [out]


def _gather_scatter(rank, world, x, g):
    got = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, got, dst=0, group=g)
    out = torch.empty_like(x)
    dist.scatter(out, [x + r for r in range(world)] if rank == 2 % world else None, src=2 % world, group=g)
    return (got or []) + [out]


def _pair_rounds(rank, world):
    """Two ranks, messages over a (4 KiB) slot: the staged-half all_reduce, every op and dtype."""
    gloo = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(10 + rank)
    bad = []
    ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                  torch.uint8):
        # past 64 KiB: the staged-half form, in many 4 KiB rounds; 5003: the one-shot rounds
        for n in (65536 // dtype.itemsize + 1, 5003, 3 * 65536 // dtype.itemsize + 5):
            x = (torch.rand(n, generator=gen) * 4).to(dtype) if dtype.is_floating_point else \
                torch.randint(0, 5, (n,), generator=gen, dtype=dtype)
            for name, op in ops.items():
                if name == "avg" and not dtype.is_floating_point:
                    continue
                if name == "avg" and dtype in (torch.bfloat16, torch.float16):
                    continue    # gloo has no AVG; checked against SUM / 2 below in float32 and 64
                mine, ref = x.clone(), x.clone()
                dist.all_reduce(mine, op=op)
                if name == "avg":
                    dist.all_reduce(ref, group=gloo)
                    ref /= world
                else:
                    dist.all_reduce(ref, op=op, group=gloo)
                if not torch.equal(mine, ref):
                    bad.append((str(dtype), n, name))
    return bad


def test_two_ranks_beyond_a_slot_match_gloo_for_every_op_and_dtype():
    res = run_ranks(_pair_rounds, 2, backend="pycoll",
                    env={"PYCOLL_TRANSPORT": "shm", "PYCOLL_SHM_SLOT_BYTES": "4096"})
    assert res == [[], []], res


@pytest.mark.parametrize("world", [2, 3, 4])
def test_many_rounds_match_gloo(world):
    res = run_ranks(_many_rounds, world, backend="pycoll",
                    env={"PYCOLL_TRANSPORT": "shm", "PYCOLL_SHM_SLOT_BYTES": "4096"})
    assert all(all(r) for r in res), res


def _overflow(rank, world):
    """Float overflow and 0/0 in a small all_reduce: inf and nan as gloo gives, no warning."""
    import warnings
    gloo = dist.new_group(backend="gloo")
    x = torch.tensor([3e38, -3e38, 1.0, 0.0], dtype=torch.float32)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a numpy RuntimeWarning would fail the call
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG):
            mine, ref = x.clone(), x.clone()
            dist.all_reduce(mine, op=op)
            dist.all_reduce(ref, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=gloo)
            if op == dist.ReduceOp.AVG:
                ref /= world
            out.append(torch.equal(mine.isnan(), ref.isnan()) and
                       torch.equal(mine.nan_to_num(), ref.nan_to_num()))
    return out


def test_small_all_reduce_overflows_quietly_as_gloo():
    res = run_ranks(_overflow, 3, backend="pycoll", env={"PYCOLL_TRANSPORT": "shm"})
    assert res == [[True] * 3] * 3, res


def _rss_growth(rank, world, gib):
    t = torch.ones(int(gib * (1 << 30)) // 4)
    dist.all_reduce(torch.ones(8 << 20))  # warm: scratch buffers and every shared slot touched
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.all_reduce(t)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ok = bool((t == world).all())
    return after - before, ok


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_1gib_all_reduce_memory_is_bounded_by_segments(transport):
    segment = 4 << 20
    res = run_ranks(_rss_growth, 2, 1.0, backend="pycoll", timeout=240,
                    env={"PYCOLL_TRANSPORT": transport, "PYCOLL_SEGMENT_BYTES": str(segment),
                         "PYCOLL_SHM_SLOT_BYTES": str(segment)})
    for growth, ok in res:
        assert ok
        assert growth <= 2 * segment, f"peak RSS grew by {growth / 2**20:.1f} MiB (segment 4 MiB)"


def _early_destroy(rank, world):
    dist.barrier()
    if rank == 1:
        dist.destroy_process_group()
        return "left"
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as exc:  # noqa: BLE001
        return time.monotonic() - t0, str(exc)
    return "no error"


def test_peer_that_destroys_its_group_is_reported_at_once():
    res = run_ranks(_early_destroy, 2, backend="pycoll", env={"PYCOLL_TRANSPORT": "shm"})
    delay, text = res[0]
    assert delay < 2.0 and "rank 1" in text and "destroyed its process group" in text, res


def _killed_between_create_and_map(rank, world):
    """Local rank 0 is killed the moment it has published its new segment, before any other
    rank could map it: the window in which a named segment would be left behind."""
    from pycoll.shm import arena as shm

    original = shm._map_segment

    def map_then_die(store, key, local_rank, size, total, timeout):
        if local_rank != 0:
            return original(store, key, local_rank, size, total, timeout)

        class DieAfterPublishing:
            def __getattr__(self, name):
                return getattr(store, name)

            def set(self, k, v):
                store.set(k, v)
                os.kill(os.getpid(), signal.SIGKILL)
        return original(DieAfterPublishing(), key, local_rank, size, total, timeout)

    shm._map_segment = map_then_die
    try:
        dist.init_process_group("pycoll", rank=rank, world_size=world, store=rank_store(),
                                timeout=timedelta(seconds=10))
    except Exception as exc:  # noqa: BLE001 - the survivor's error is the result
        gc.collect()
        return f"{type(exc).__name__}: {exc}", pycoll_memory()
    finally:
        shm._map_segment = original
    dist.destroy_process_group()
    return "no error", []


def test_kill9_between_creating_and_mapping_the_segment_leaves_nothing():
    """The survivor's failed init leaves it nothing mapped or open (and the dead creator's
    memory had no name: it went with the process)."""
    for _ in range(3):
        res = run_ranks(_killed_between_create_and_map, 2, timeout=60, may_die=(0,),
                        env={"PYCOLL_TRANSPORT": "shm"})
        assert res[0] == "died"
        error, held = res[1]
        assert re.search(r"rank 0\b.*died", error), error
        assert held == [], held


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_open_the_segment():
    from datetime import timedelta as td

    from pycoll.shm.arena import ShmArena

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=td(seconds=30))
    arenas = {}
    creator = threading.Thread(target=lambda: arenas.setdefault(0, ShmArena(store, "arena", 0, 2, [0, 1], 20.0)))
    creator.start()
    # A client of its own: one TCPStore object's get blocks its other users until it returns.
    client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, timeout=td(seconds=30))
    path = client.get("arena/name").decode()
    pid = os.fork()
    if pid == 0:   # another user tries to open the segment while it waits for rank 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.open(path, os.O_RDWR)
            os._exit(1)
        except PermissionError:
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    arenas[1] = ShmArena(store, "arena", 1, 2, [0, 1], 20.0)
    creator.join(20)
    try:
        assert os.waitstatus_to_exitcode(status) == 0, "another user opened the segment"
        assert not path.startswith("/dev/shm")
    finally:
        for a in arenas.values():
            a.close()
