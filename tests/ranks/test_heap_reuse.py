"""The shared heap's reuse of freed blocks (``shm.heap``: Agreement).

Real rank processes on the reused pool, real shared memory. A freed block is reused only
when every rank has freed it and proposes it: ranks that free in different orders still
agree, a rank that keeps its tensor alive makes the others bump (and its tensor is never
written by a collective on the new one), the cache's bound holds, and destroy empties it.
Every reused block is checked by a registered all_reduce on it (its offsets must agree on
every rank, or the collective fails with a MismatchError).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.ranks import run_ranks
from tests.support.registered import _heap_maps, _heap_rss

pytestmark = pytest.mark.timeout(300)

N = 40000           # float32: 160000 bytes, over the registered all_reduce's threshold


def _heap():
    return dist.distributed_c10d._get_default_group().communicator.heap


def _summed(t: torch.Tensor, rank: int, world: int) -> bool:
    """A registered all_reduce on ``t`` gives the sum of every rank's fill."""
    t.fill_(rank + 1)
    dist.all_reduce(t)
    return bool((t == world * (world + 1) / 2).all())


def _reuse_in_any_free_order(rank, world):
    import pycoll

    a, b = pycoll.empty_shared(N), pycoll.empty_shared(N)
    where = {"a": a.data_ptr(), "b": b.data_ptr()}
    chunks = len(_heap().chunks)
    if rank == 0:       # the ranks free in opposite orders
        del a, b
    else:
        del b, a
    gc.collect()
    cached = _heap().cached_blocks()
    c, d = pycoll.empty_shared(N), pycoll.empty_shared(N)
    ok = _summed(c, rank, world) and _summed(d, rank, world)
    return {"cached": cached, "c_is_a": c.data_ptr() == where["a"], "d_is_b": d.data_ptr() == where["b"],
            "chunks_same": len(_heap().chunks) == chunks, "ok": ok, "left": _heap().cached_blocks()}


def test_freed_blocks_are_reused_whatever_order_the_ranks_free_them_in():
    res = run_ranks(_reuse_in_any_free_order, 2, backend="pycoll")
    for s in res:
        assert s == {"cached": 2, "c_is_a": True, "d_is_b": True, "chunks_same": True, "ok": True,
                     "left": 0}, res


def _one_rank_keeps_it(rank, world):
    import pycoll

    a = pycoll.empty_shared(N)
    first = a.data_ptr()
    kept = None
    if rank == 1:
        kept = a            # rank 1's tensor stays alive: the block may not be reused
        kept.fill_(42)
    del a
    gc.collect()
    proposed = _heap().reusable(N * 4)
    b = pycoll.empty_shared(N)
    ok = _summed(b, rank, world)
    intact = bool((kept == 42).all()) if kept is not None else None
    # Once rank 1 frees it too, every rank proposes it again and it is reused.
    del kept
    gc.collect()
    c = pycoll.empty_shared(N)
    return {"proposed": proposed > 0, "b_new": b.data_ptr() != first, "ok": ok, "intact": intact,
            "c_reused": c.data_ptr() == first, "c_ok": _summed(c, rank, world)}


def test_a_block_one_rank_still_uses_is_not_reused_anywhere():
    res = run_ranks(_one_rank_keeps_it, 2, backend="pycoll")
    assert res[0]["proposed"] and not res[1]["proposed"], res
    for s in res:
        assert s["b_new"] and s["ok"] and s["c_reused"] and s["c_ok"], res
    assert res[1]["intact"] is True, res


def _bounded(rank, world):
    import pycoll

    xs = [pycoll.empty_shared(N) for _ in range(3)]     # 3 blocks of 40 pages
    del xs
    gc.collect()
    cached, nbytes = _heap().cached_blocks(), _heap().cached
    dist.destroy_process_group()
    gc.collect()
    return {"cached": cached, "bytes": nbytes, "after_destroy": _heap_maps()}


@pytest.mark.parametrize("cap, blocks", [(0, 0), (2 * 40 * 4096, 2)])
def test_the_cache_holds_at_most_its_bound_and_destroy_empties_it(cap, blocks):
    res = run_ranks(_bounded, 2, backend="pycoll", env={"PYCOLL_SHM_HEAP_CACHE_BYTES": str(cap)})
    for s in res:
        assert s == {"cached": blocks, "bytes": blocks * 40 * 4096, "after_destroy": 0}, res


BIG = 4 << 20       # bytes: a registered all_reduce of this touches half the peer's copy


def _pages_on_free(rank, world, cache):
    import pycoll

    x = pycoll.empty_shared(BIG // 4, group=None, cache=cache)
    ok = _summed(x, rank, world)
    before = _heap_rss()
    dist.barrier()          # (a peer freeing its block first would take its pages from ours)
    del x
    gc.collect()
    dist.barrier()          # every rank has let its copy go
    # A peer's pages leave this rank's memory when that peer frees its block, which its
    # group's worker may do a moment after the barrier (it drops an op's tensors later).
    want, deadline = BIG + BIG // 2 - 64 * 1024, time.monotonic() + 5
    while not cache and before - _heap_rss() < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"ok": ok, "cached": _heap().cached_blocks(), "dropped": before - _heap_rss()}


@pytest.mark.parametrize("cache", [True, False])
def test_a_block_made_without_cache_gives_its_pages_back(cache):
    """cache=False (DDP's buckets): the block's pages leave every rank's memory when the
    ranks free it, the peers' pages that a rank touched included; the default keeps them
    resident for the next block of that size."""
    res = run_ranks(_pages_on_free, 2, cache, backend="pycoll")
    for s in res:
        assert s["ok"], res
        if cache:
            assert s["cached"] == 1 and s["dropped"] < BIG // 4, res
        else:   # its own 4 MiB and the 2 MiB of the peer's copy it reduced
            assert s["cached"] == 0 and s["dropped"] >= BIG + BIG // 2 - 64 * 1024, res


PEER_N = 300_001    # float32 elements: slices that end mid-page, at world 2 and 3


def _peers_pages(rank, world, unmap):
    """A registered all_reduce (twice: the second runs on pages the first unmapped),
    all_gather_into_tensor into and reduce_scatter_tensor from registered memory; the
    results, and how much of the heap this rank has mapped after."""
    import pycoll

    x = pycoll.empty_shared(PEER_N, unmap_peers=unmap)
    ok = _summed(x, rank, world) and _summed(x, rank, world)
    inp = torch.arange(PEER_N, dtype=torch.float32) + rank
    out = pycoll.empty_shared(world * PEER_N, unmap_peers=unmap)
    dist.all_gather_into_tensor(out, inp)
    ok &= all(torch.equal(out[q * PEER_N:(q + 1) * PEER_N], torch.arange(PEER_N, dtype=torch.float32) + q)
              for q in range(world))
    big = pycoll.empty_shared(world * PEER_N, unmap_peers=unmap)
    big.copy_(torch.arange(world * PEER_N, dtype=torch.float32) * (rank + 1))
    mine = torch.empty(PEER_N)
    dist.reduce_scatter_tensor(mine, big)
    want = torch.arange(rank * PEER_N, (rank + 1) * PEER_N, dtype=torch.float32) * (world * (world + 1) / 2)
    ok &= torch.equal(mine, want)
    got = {"ok": ok, "rss": _heap_rss(), "kept": _heap().kept}
    dist.barrier()          # nobody frees (and so unmaps its pages from the others) before all looked
    return got


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("unmap, budget", [(False, None), (False, 0), (True, None), (True, 0)])
def test_peers_pages_are_unmapped_beyond_the_bound_when_asked(world, unmap, budget):
    """Peers' pages stay mapped (and in this rank's RSS) by default; with unmap_peers, at
    most PYCOLL_SHM_PEER_BYTES of them (8 MiB by default, which these fit in): beyond it the
    in-place collectives unmap them as they go, and the results are the same, though the
    next collective faults them in again."""
    env = {} if budget is None else {"PYCOLL_SHM_PEER_BYTES": str(budget)}
    res = run_ranks(_peers_pages, world, unmap, backend="pycoll", env=env)
    own = PEER_N * 4 * (1 + 2 * world)                      # x, out and big: every page read or written
    touched = (world - 1) * (PEER_N * 4 // world + PEER_N * 4 + PEER_N * 4)  # slice of x, block of out, of big
    for s in res:
        assert s["ok"], res
        if not unmap or budget is None:     # all of it stays mapped
            assert s["rss"] >= own + touched - 16 * 4096, res
            assert (s["kept"] >= touched - 4096 * world) if unmap else s["kept"] == 0, res
        else:       # only this rank's own pages (and a page or two at block ends)
            assert s["kept"] == 0 and own <= s["rss"] <= own + 16 * 4096, res
