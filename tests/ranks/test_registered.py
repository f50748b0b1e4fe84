"""Registered buffers (``pycoll.empty_shared``) and the in-place all_reduce on them.

Real rank processes on the reused pool (pycoll/testing/ranks.py), real shared memory: results
against a reference reduction in rank order, for every dtype and op the shared-memory
all_reduce takes, sizes around the registered path's threshold, world sizes 2-4; a
registration that differs between ranks is a MismatchError on every rank and corrupts
nothing; the heap's lifetime (freed at destroy, no descriptor or mapping left); and ddp/
with buckets in registered memory trains exactly as with ordinary buckets.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import run_ranks
from tests.support.registered import (
    DTYPE_OPS,
    _heap_fds,
    _heap_maps,
    _inputs,
    _redop,
    _reference,
)

pytestmark = pytest.mark.timeout(300)

BIG = 16384 + 37          # float32: just over the one-shot threshold (64 KiB), odd
MANY = 3 * 65536 + 11     # several pieces of the registered all_reduce, not divisible by 2-4


def _count_registered():
    """Count the registered all_reduce's slice reductions in this rank (the path taken)."""
    from pycoll.shm import registered as R

    calls = []
    original = R._reduce_slice

    def counted(*args):
        calls.append(1)
        return original(*args)
    R._reduce_slice = counted
    return calls, lambda: setattr(R, "_reduce_slice", original)


def _all_reduce_cases(rank, world, cases):
    import pycoll

    calls, undo = _count_registered()
    out = []
    try:
        for n, dtype, op in cases:
            t = pycoll.empty_shared((n,), dtype=dtype)
            t.copy_(_inputs(rank, n, dtype, op))
            before = len(calls)
            dist.all_reduce(t, op=_redop(op, dtype))
            ref = _reference(world, n, dtype, op)
            if dtype.is_floating_point or dtype.is_complex:
                tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
                ok = torch.allclose(t.to(ref.dtype), ref, rtol=tol, atol=tol)
            else:
                ok = torch.equal(t, ref)
            out.append((n, str(dtype), op, bool(ok), len(calls) - before, pycoll.is_registered(t) if n else None,
                        t.view(-1)[:4].tolist(), float(t.double().sum()) if not dtype.is_complex else 0.0))
    finally:
        undo()
    return out


def _check(results, cases, world):
    for i, (n, dtype, op) in enumerate(cases):
        rows = [r[i] for r in results]
        assert all(row[3] for row in rows), (n, dtype, op, rows)
        assert len({(tuple(row[6]), row[7]) for row in rows}) == 1, f"ranks disagree: {rows}"
        big = n * torch.empty(0, dtype=dtype).element_size() > 65536
        assert all(row[4] == (1 if big else 0) for row in rows), f"path: {rows}"
        if n:
            assert all(row[5] for row in rows), rows


def _sizes(dtype):
    item = torch.empty(0, dtype=dtype).element_size()
    return [0, 1, 65536 // item + 1, MANY // item]


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_every_dtype_and_op(world):
    cases = [(n, dt, op) for dt, ops in DTYPE_OPS for op in ops for n in _sizes(dt)]
    res = run_ranks(_all_reduce_cases, world, cases, backend="pycoll", timeout=240)
    _check(res, cases, world)


def test_all_reduce_world_4():
    cases = [(n, torch.float32, op) for op in ("sum", "avg", "max") for n in (0, 1, 7, BIG, MANY)]
    cases += [(MANY, torch.int64, "sum"), (MANY // 2, torch.bfloat16, "sum")]
    res = run_ranks(_all_reduce_cases, 4, cases, backend="pycoll", timeout=240)
    _check(res, cases, 4)


def _mixed(rank, world, n):
    """Registered and ordinary tensors interleaved, sub-views, async ops, repeated use."""
    import pycoll

    calls, undo = _count_registered()
    try:
        a = pycoll.empty_shared((4, n // 4), dtype=torch.float32)
        b = pycoll.empty_shared(n, dtype=torch.float64)
        plain = torch.empty(n)
        sums = []
        for step in range(3):
            a.fill_(rank + step)
            b.fill_(2.0 * rank)
            plain.fill_(rank + 1)
            works = [dist.all_reduce(x, async_op=True) for x in (a, plain, b)]
            dist.all_reduce(a.view(-1)[n // 4:])          # a registered sub-view, same offset everywhere
            for w in works:
                w.wait()
            sums.append((a[0, 0].item(), a[3, 0].item(), b[0].item(), plain[0].item()))
        return sums, len(calls)
    finally:
        undo()


def test_mixed_registered_and_plain_async():
    n = 4 * BIG
    res = run_ranks(_mixed, 2, n, backend="pycoll")
    for sums, ncalls in res:
        assert ncalls == 9, res         # a, b and the sub-view of a, three times; plain is staged
        for step, (a0, a3, b0, p0) in enumerate(sums):
            s = (0 + step) + (1 + step)
            assert (a0, a3, b0, p0) == (s, 2 * s, 2.0, 3.0), res


# -- mismatches ----------------------------------------------------------------------------
def _mismatch(rank, world, how):
    import pycoll

    n = BIG
    if how == "alloc":
        try:
            pycoll.empty_shared(n + rank * 1024)
        except pycoll.MismatchError as e:
            return str(e)
        return "no error"
    reg = pycoll.empty_shared(n)
    other = pycoll.empty_shared(n)
    plain = torch.empty(n)
    for x in (reg, other, plain):
        x.fill_(rank + 1)
    t = {"plain": plain if rank == 1 else reg, "offset": other if rank == 1 else reg}[how]
    try:
        dist.all_reduce(t)
    except pycoll.MismatchError as e:
        return str(e), reg.sum().item(), other.sum().item(), plain.sum().item()
    return "no error"


@pytest.mark.parametrize("how", ["plain", "offset", "alloc"])
def test_registration_mismatch_is_an_error_everywhere(how):
    import pycoll  # noqa: F401  (registers the backend in this process)

    res = run_ranks(_mismatch, 2, how, backend="pycoll")
    for rank, r in enumerate(res):
        assert r != "no error", res
        msg = r if how == "alloc" else r[0]
        assert "mismatch" in msg, res
        if how == "alloc":
            assert "empty_shared" in msg, res
            continue
        assert "registered memory at heap offset" in msg, res
        if how == "plain":
            assert "unregistered memory" in msg, res
        # nothing was reduced into anybody's memory
        assert r[1:] == (BIG * (rank + 1.0),) * 3, res


# -- lifetime ------------------------------------------------------------------------------


def _lifetime(rank, world):
    import pycoll

    pg = dist.distributed_c10d._get_default_group()
    heap_of = (lambda: pg.communicator.heap)
    small = [pycoll.empty_shared(1000) for _ in range(3)]       # one chunk
    big = pycoll.empty_shared((70 << 20) // 4)                   # its own chunk (> 64 MiB)
    big.fill_(1)
    dist.all_reduce(big)
    seen = {"maps": _heap_maps(), "fds": _heap_fds(), "chunks": len(heap_of().chunks),
            "live": heap_of().live_blocks(), "big": big[-1].item()}
    del small
    gc.collect()
    seen["live_after_del"] = heap_of().live_blocks()
    keep = pycoll.empty_shared(10)
    keep.fill_(7)
    del big
    gc.collect()
    seen["maps_after_big"] = _heap_maps()
    dist.destroy_process_group()
    gc.collect()
    seen["maps_after_destroy"] = _heap_maps()
    seen["keep"] = keep.sum().item()          # still valid memory after destroy
    del keep
    gc.collect()
    seen["maps_at_end"] = _heap_maps()
    seen["fds_at_end"] = _heap_fds()
    return seen


def test_heap_lifetime_freed_at_destroy_no_fds():
    res = run_ranks(_lifetime, 2, backend="pycoll")
    for s in res:
        # rank 0's creating descriptor is closed once all mapped; what is left is the one
        # Python's mmap object keeps of its own, per chunk (gone with the mapping)
        assert s["fds"] <= s["chunks"] and s["fds_at_end"] == 0, res
        assert s["chunks"] == 2 and s["live"] == 4 and s["big"] == 2.0, res
        assert s["live_after_del"] == 1, res
        assert s["maps_after_big"] >= 1 and s["maps_after_destroy"] >= 1, res   # 'keep' holds its chunk
        assert s["keep"] == 70.0, res
        assert s["maps_at_end"] == 0, res


def _plain_when_not_shm(rank, world):
    import pycoll

    t = pycoll.empty_shared((3, 5), dtype=torch.int16)
    return pycoll.can_share_memory(), pycoll.is_registered(t), tuple(t.shape), str(t.dtype)


def test_tcp_group_gets_plain_memory():
    res = run_ranks(_plain_when_not_shm, 2, backend="pycoll", env={"PYCOLL_TRANSPORT": "tcp"})
    assert res == [(False, False, (3, 5), "torch.int16")] * 2


def _scratch(rank, world):
    import pycoll

    pg = dist.distributed_c10d._get_default_group()
    a = pycoll.shared_scratch("k", 40000, torch.float32)
    same = pycoll.shared_scratch("k", 40000, torch.float32)
    other_key = pycoll.shared_scratch("j", 40000, torch.float32)
    resized = pycoll.shared_scratch("k", 50000, torch.float32)
    retyped = pycoll.shared_scratch("k", 50000, torch.float16)
    seen = {"same": same.data_ptr() == a.data_ptr(), "other_key": other_key.data_ptr() != a.data_ptr(),
            "resized": (resized.numel(), resized.data_ptr() != a.data_ptr()),
            "retyped": (retyped.dtype, retyped.numel()),
            "registered": all(pycoll.is_registered(t) for t in (a, other_key, retyped)),
            "kept": sorted(pg.communicator.scratch)}
    del a, same, other_key, resized, retyped
    gc.collect()
    if pycoll.can_share_memory():
        heap = pg.communicator.heap
        seen["live_before_destroy"] = heap.live_blocks()
        seen["cached"] = heap.cached_blocks()     # replaced scratch gives its pages back
    dist.destroy_process_group()
    gc.collect()
    seen["maps_after_destroy"] = _heap_maps()
    return seen


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_shared_scratch_reuses_per_key_and_destroy_drops_it(transport):
    """One tensor per key while its size and dtype hold, a new one when they change;
    registered on one host (the old ones' pages given back), plain over TCP; destroying the
    group drops the group's scratch, leaving no heap mapping behind."""
    env = {"PYCOLL_TRANSPORT": "tcp"} if transport == "tcp" else None
    for s in run_ranks(_scratch, 2, backend="pycoll", env=env):
        assert s["same"] and s["other_key"] and s["resized"] == (50000, True), s
        assert s["retyped"] == (torch.float16, 50000) and s["kept"] == ["j", "k"], s
        assert s["registered"] == (transport == "shm"), s
        if transport == "shm":
            assert s["live_before_destroy"] == 2 and s["cached"] == 0, s
        assert s["maps_after_destroy"] == 0, s


# -- ddp/ ----------------------------------------------------------------------------------
def _ddp_train(rank, world, view, shared, cap):
    import pycoll
    from ddp import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=cap, first_bucket_cap_mb=0.1,
                                    gradient_as_bucket_view=view, shared_buckets=shared)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    registered = [pycoll.is_registered(b.buffer) for b in model.reducer.buckets]
    views = [p.grad.data_ptr() == v.data_ptr() for b in model.reducer.buckets for p, v in zip(b.params, b.views)]
    return [p.detach().clone() for p in net.parameters()], registered, all(views)


@pytest.mark.parametrize("view", [False, True])
def test_ddp_registered_buckets_equal_plain(view):
    got = {}
    for shared in (True, False):
        got[shared] = run_ranks(_ddp_train, 2, view, shared, 0.25, backend="pycoll")
    for rank in range(2):
        params_s, reg_s, views_s = got[True][rank]
        params_p, reg_p, views_p = got[False][rank]
        assert all(reg_s) and len(reg_s) > 1 and not any(reg_p), (reg_s, reg_p)
        assert views_s == views_p == view
        for a, b in zip(params_s, params_p):
            assert torch.equal(a, b)
    for a, b in zip(got[True][0][0], got[True][1][0]):
        assert torch.equal(a, b)


class _Reordered(torch.nn.Module):
    """parameters() order is not the backward order, and the rebuild changes bucket sizes."""

    def __init__(self):
        super().__init__()
        self.late, self.mid, self.early = (torch.nn.Linear(512, 700), torch.nn.Linear(256, 512),
                                           torch.nn.Linear(256, 256))

    def forward(self, x):
        return self.late(torch.relu(self.mid(torch.relu(self.early(x)))))


def _ddp_rebuild_memory(rank, world):
    from ddp import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(_Reordered(), bucket_cap_mb=1.2, first_bucket_cap_mb=0.2)
    before = [b.nbytes for b in model.reducer.buckets]
    x = torch.randn(4, 256)
    for _ in range(3):
        model(x).sum().backward()
    heap = dist.distributed_c10d._get_default_group().communicator.heap
    gc.collect()
    return before, [b.nbytes for b in model.reducer.buckets], heap.cached_blocks(), heap.live_blocks()


def test_ddp_rebuild_gives_the_old_buckets_memory_back():
    """Buckets replaced by a rebuild release their pages (not kept in the heap's cache,
    where blocks of their sizes would never be asked for again)."""
    for before, after, cached, live in run_ranks(_ddp_rebuild_memory, 2, backend="pycoll"):
        assert sorted(before) != sorted(after), (before, after)     # the rebuild changed sizes
        assert cached == 0 and live == len(after), (cached, live, after)


def _ddp_bucket_rss(rank, world, budget, hook):
    from ddp import DistributedDataParallel, hooks
    from tests.support.registered import _heap_rss

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))   # 16 MiB of grads
    model = DistributedDataParallel(net, bucket_cap_mb=64, first_bucket_cap_mb=64)      # one bucket
    if hook:    # its compressed copy (8.4 MB, registered) is reduced instead of the bucket
        model.register_comm_hook(None, hooks.fp16_compress_hook)
    x = torch.randn(4, 1024)
    for _ in range(3):
        model(x).sum().backward()
    heap = dist.distributed_c10d._get_default_group().communicator.heap
    rss = _heap_rss()
    grads = torch.cat([p.grad.flatten() for p in net.parameters()])
    everyone = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(everyone, grads)    # (and nobody frees its bucket before all measured)
    return {"rss": rss, "bucket": model.reducer.buckets[0].buffer.nbytes, "kept": heap.kept,
            "buckets": len(model.reducer.buckets), "equal": all(torch.equal(everyone[0], g) for g in everyone)}


@pytest.mark.parametrize("budget, hook", [(None, False), (64 << 20, False), (0, True), (64 << 20, True)])
def test_ddp_buckets_count_once_in_rss(budget, hook):
    """A DDP rank keeps none of its peer's bucket pages mapped beyond PYCOLL_SHM_PEER_BYTES
    (default 8 MiB; the half it reduces here is 8.4 MB): its share of the heap in RSS is
    its own bucket, as with ordinary buckets; so with the fp16 hook, whose compressed copy
    is reduced in its place. With a larger bound the peer's pages stay mapped."""
    env = {} if budget is None else {"PYCOLL_SHM_PEER_BYTES": str(budget)}
    for s in run_ranks(_ddp_bucket_rss, 2, budget, hook, backend="pycoll", env=env):
        assert s["equal"] and s["buckets"] == 1, s
        own = s["bucket"] * 3 // 2 if hook else s["bucket"]    # the bucket (+ its fp16 copy)
        reduced = own - s["bucket"] if hook else s["bucket"]   # what the all_reduce runs on
        if not budget:
            assert s["kept"] == 0 and own <= s["rss"] <= own + 256 * 1024, s
        else:
            assert s["kept"] >= reduced // 2 - 4096 and s["rss"] >= own + reduced // 2 - 65536, s


def test_ddp_on_gloo_keeps_plain_buckets():
    res = run_ranks(_ddp_train, 2, True, None, 0.25, backend="gloo")
    assert not any(res[0][1]) and res[0][2]


def _ddp_hook_train(rank, world, hook):
    import pycoll
    from ddp import DistributedDataParallel, hooks

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                              torch.nn.ReLU(), torch.nn.Linear(512, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=0.5, first_bucket_cap_mb=0.5)
    model.register_comm_hook(None, getattr(hooks, hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    shm = pycoll.can_share_memory()
    calls, restore = _count_registered() if shm else ([], lambda: None)
    seen = []
    try:
        for _ in range(4):
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            scratch = backend.communicator.scratch if hasattr(backend, "communicator") else {}
            seen.append(sorted((k[1], t.data_ptr(), t.dtype, pycoll.is_registered(t)) for k, t in scratch.items()))
    finally:
        restore()
    return [p.detach().clone() for p in net.parameters()], seen, len(calls), len(model.reducer.buckets)


@pytest.mark.parametrize("hook", ["fp16_compress_hook", "bf16_compress_hook"])
def test_compression_hooks_reduce_in_registered_memory(hook):
    res = run_ranks(_ddp_hook_train, 2, hook, backend="pycoll")
    ref = run_ranks(_ddp_hook_train, 2, hook, backend="gloo")
    dtype = torch.float16 if hook.startswith("fp16") else torch.bfloat16
    for rank in range(2):
        params, seen, calls, nbuckets = res[rank]
        # One compressed buffer per bucket, registered, the same memory at every step
        # (the first step's buckets are rebuilt after it, hence from the second step on).
        assert nbuckets > 1 and len(seen[1]) == nbuckets, seen
        assert all(s == seen[1] for s in seen[1:]), seen
        assert all(reg and dt == dtype for _, _, dt, reg in seen[1]), seen
        assert calls >= 3 * nbuckets, calls          # reduced in place, step after step
        # Two ranks: a/2 + b/2 in half precision rounds alike in any order, so registered
        # on pycoll and plain on gloo agree bit for bit.
        for a, b in zip(params, ref[rank][0]):
            assert torch.equal(a, b)
        assert ref[rank][1] == [[]] * 4              # gloo: no registered scratch


def _die_in_registered(rank, world, victim):
    import signal
    import threading
    import time

    import pycoll

    t = pycoll.empty_shared(4 << 20)
    t.fill_(1)
    if rank == victim:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(100000):
            dist.all_reduce(t)
            t.fill_(1)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}", _heap_fds()
    return None


def test_kill9_inside_a_registered_all_reduce():
    res = run_ranks(_die_in_registered, 2, 1, backend="pycoll", may_die=(1,))
    assert res[1] == "died"
    elapsed, text, fds = res[0]
    assert elapsed < 10 and "rank 1" in text, res
    assert fds <= 1, res    # the mmap's own descriptor of its one chunk, nothing of the dead rank's
