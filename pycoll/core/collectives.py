"""Collectives on flat tensors: pick the path (TCP schedule, shared memory, hierarchy), run it.

Each function takes already validated, flat, contiguous 1-D tensors (the c10d layer does
the validation and any reshaping) and ends with ``seq, deadline`` so that the communicator
can call it as a task. The signature that travels in every frame header (TCP) or control
line (shared memory) is built here.

Paths, by ``comm.mode``: "tcp" runs the tuner's schedule over sockets; "shm" runs the
direct shared-memory algorithms of ``shm/algorithms.py``; "hierarchical" reduces within
each host in shared memory, all-reduces across hosts between one leader per host over
TCP, and broadcasts within each host (all_reduce, broadcast, barrier); the other
collectives take the flat TCP schedule across all ranks.
"""

from __future__ import annotations

import functools

import torch

from pycoll.shm import algorithms as shm
from pycoll.shm import registered as registered
from pycoll.core.kernels import copy
from pycoll.core.reductions import Reduction
from pycoll.shm.rounds import counts_hash, signature
from pycoll.wire import Signature


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _what(op: str, seq: int) -> str:
    return f"{op} seq {seq}"


def _local_root(comm, root: int) -> int:
    return comm.arena.ranks.index(root)


def all_reduce_task(comm, t: torch.Tensor, red: Reduction):
    """The task that all-reduces flat ``t``: ``all_reduce`` bound to its arguments, or, for a
    message that one shared-memory round holds, ``small_all_reduce``: the latency path,
    chosen here once so that running it costs two Python frames and their checks fewer."""
    if (comm.mode == "shm" and red.factor is None and shm.is_small_all_reduce(comm.arena, t, red)
            and not (comm.heap is not None and registered.wants_lookup(t))):   # (in place instead)
        return functools.partial(_small_all_reduce_step, comm.arena, t, red)
    return functools.partial(all_reduce, comm, t, red)


def _small_all_reduce_step(arena, t: torch.Tensor, red: Reduction, seq: int, deadline: float) -> None:
    shm.small_all_reduce(arena, t, red, signature("all_reduce", seq, t.dtype, t.numel(), red.name),
                         deadline, f"all_reduce seq {seq}")
    red.finish(t)


def all_reduce(comm, t: torch.Tensor, red: Reduction, seq: int, deadline: float) -> None:
    red.prepare(t)
    if comm.mode == "shm" and comm.heap is not None and registered.wants_lookup(t):
        # The group has registered memory (pycoll.empty_shared): in place if t lies there.
        registered.all_reduce(comm.arena, comm.heap, t, red, seq, deadline)
        return
    if comm.mode == "shm":
        shm.all_reduce(comm.arena, t, red, signature("all_reduce", seq, t.dtype, t.numel(), red.name),
                       deadline, f"all_reduce seq {seq}")
    elif comm.mode == "hierarchical":
        _hierarchical_all_reduce(comm, t, red, seq, deadline)
    else:
        sig = Signature("all_reduce", seq, dtype_name(t.dtype), t.numel(), red.name)
        comm.run_schedule("all_reduce", t.nbytes, (t.numel(),), {"in": t, "out": t}, sig, red, deadline)
    red.finish(t)


def _hierarchical_all_reduce(comm, t, red, seq, deadline) -> None:
    arena, what = comm.arena, _what("all_reduce", seq)
    words = signature("all_reduce", seq, t.dtype, t.numel(), red.name)
    leader = arena.me == 0
    shm.reduce(arena, t, t if leader else None, 0, red, words, deadline, what)
    if leader and len(comm.leaders) > 1:
        sig = Signature("all_reduce", seq, dtype_name(t.dtype), t.numel(), red.name)
        comm.run_schedule("all_reduce", t.nbytes, (t.numel(),), {"in": t, "out": t}, sig, red, deadline,
                          leaders_only=True)
    shm.broadcast(arena, t, 0, signature("broadcast", seq, t.dtype, t.numel(), root=0), deadline, what)


def broadcast(comm, t: torch.Tensor, root: int, seq: int, deadline: float) -> None:
    what = _what("broadcast", seq)
    if comm.mode == "shm":
        words = signature("broadcast", seq, t.dtype, t.numel(), root=root)
        shm.broadcast(comm.arena, t, _local_root(comm, root), words, deadline, what)
        return
    if comm.mode == "hierarchical":
        words = signature("broadcast", seq, t.dtype, t.numel(), root=root)
        root_host = comm.host_of[root]
        mine = comm.host_of[comm.rank] == root_host
        if mine:
            shm.broadcast(comm.arena, t, _local_root(comm, root), words, deadline, what)
        if comm.rank in comm.leaders and len(comm.leaders) > 1:
            sig = Signature("broadcast", seq, dtype_name(t.dtype), t.numel(), root=root)
            comm.run_schedule("broadcast", t.nbytes, (t.numel(), root_host), {"in": t, "out": t}, sig, None,
                              deadline, leaders_only=True)
        if not mine:
            shm.broadcast(comm.arena, t, 0, words, deadline, what)
        return
    sig = Signature("broadcast", seq, dtype_name(t.dtype), t.numel(), root=root)
    comm.run_schedule("broadcast", t.nbytes, (t.numel(), root), {"in": t, "out": t}, sig, None, deadline)


def reduce(comm, t: torch.Tensor, root: int, red: Reduction, seq: int, deadline: float) -> None:
    # Non-root inputs stay untouched: a PREMUL_SUM factor is applied to a copy.
    src = t
    if red.factor is not None:
        src = t.clone()
        red.prepare(src)
    if comm.mode == "shm":
        words = signature("reduce", seq, t.dtype, t.numel(), red.name, root)
        shm.reduce(comm.arena, src, t if comm.rank == root else None, _local_root(comm, root), red, words,
                   deadline, _what("reduce", seq))
    else:
        sig = Signature("reduce", seq, dtype_name(t.dtype), t.numel(), red.name, root)
        comm.run_schedule("reduce", t.nbytes, (t.numel(), root),
                          {"in": src, "out": src if comm.rank == root else t}, sig, red, deadline)
        if comm.rank == root and src is not t:
            copy(t, src)
    if comm.rank == root:
        red.finish(t)


def all_gather(comm, out: torch.Tensor, inp: torch.Tensor, seq: int, deadline: float) -> None:
    if comm.mode == "shm" and comm.heap is not None and registered.wants_lookup(inp):
        registered.all_gather(comm.arena, comm.heap, out, inp, seq, deadline)
        return
    if comm.mode == "shm":
        words = signature("all_gather", seq, inp.dtype, inp.numel())
        shm.all_gather(comm.arena, out, inp, -1, words, deadline, _what("all_gather", seq))
        return
    sig = Signature("all_gather", seq, dtype_name(inp.dtype), inp.numel())
    comm.run_schedule("all_gather", out.nbytes, (inp.numel(),), {"in": inp, "out": out}, sig, None, deadline)


def gather(comm, out: torch.Tensor | None, inp: torch.Tensor, root: int, seq: int, deadline: float) -> None:
    if comm.mode == "shm":
        words = signature("gather", seq, inp.dtype, inp.numel(), root=root)
        shm.all_gather(comm.arena, out, inp, _local_root(comm, root), words, deadline, _what("gather", seq))
        return
    sig = Signature("gather", seq, dtype_name(inp.dtype), inp.numel(), root=root)
    bufs = {"in": inp, "out": out if out is not None else inp[:0]}
    comm.run_schedule("gather", inp.nbytes * comm.world, (inp.numel(), root), bufs, sig, None, deadline)


def scatter(comm, out: torch.Tensor, inp: torch.Tensor | None, root: int, seq: int, deadline: float) -> None:
    if comm.mode == "shm":
        words = signature("scatter", seq, out.dtype, out.numel(), root=root)
        shm.scatter(comm.arena, out, inp, _local_root(comm, root), words, deadline, _what("scatter", seq))
        return
    sig = Signature("scatter", seq, dtype_name(out.dtype), out.numel(), root=root)
    bufs = {"in": inp if inp is not None else out[:0], "out": out}
    comm.run_schedule("scatter", out.nbytes * comm.world, (out.numel(), root), bufs, sig, None, deadline)


def reduce_scatter(comm, out: torch.Tensor, inp: torch.Tensor, counts: tuple[int, ...], red: Reduction,
                   seq: int, deadline: float) -> None:
    if red.factor is not None:
        inp = inp.clone()
        red.prepare(inp)
    if comm.mode == "shm" and comm.heap is not None and registered.wants_lookup(inp):
        registered.reduce_scatter(comm.arena, comm.heap, out, inp, counts, red, seq, deadline)
    elif comm.mode == "shm":
        words = signature("reduce_scatter", seq, inp.dtype, inp.numel(), red.name,
                          extra=counts_hash(counts))
        shm.reduce_scatter(comm.arena, out, inp, counts, red, words, deadline, _what("reduce_scatter", seq))
    else:
        sig = Signature("reduce_scatter", seq, dtype_name(inp.dtype), inp.numel(), red.name)
        comm.run_schedule("reduce_scatter", inp.nbytes, (counts,), {"in": inp, "out": out}, sig, red, deadline)
    red.finish(out)


def all_to_all(comm, out: torch.Tensor, inp: torch.Tensor, send_counts: tuple[int, ...],
               recv_counts: tuple[int, ...], seq: int, deadline: float) -> None:
    if comm.mode == "shm":
        words = signature("all_to_all", seq, inp.dtype, comm.world)
        shm.all_to_all(comm.arena, out, inp, send_counts, recv_counts, words, deadline,
                       _what("all_to_all", seq))
        return
    # numel in the signature is the world size, the one figure every pair shares;
    # per-pair sizes are checked by each frame's byte count.
    sig = Signature("all_to_all", seq, dtype_name(inp.dtype), comm.world)
    comm.run_schedule("all_to_all", inp.nbytes, (send_counts, recv_counts), {"in": inp, "out": out},
                      sig, None, deadline)


def barrier(comm, seq: int, deadline: float) -> None:
    what = _what("barrier", seq)
    words = signature("barrier", seq, torch.uint8, 0)
    if comm.mode == "shm":
        shm.barrier(comm.arena, words, deadline, what)
        return
    if comm.mode == "hierarchical":
        shm.barrier(comm.arena, words, deadline, what)
    if comm.mode == "tcp" or (comm.rank in comm.leaders and len(comm.leaders) > 1):
        empty = torch.empty(0, dtype=torch.uint8)
        sig = Signature("barrier", seq, "uint8", 0)
        comm.run_schedule("barrier", 0, (), {"in": empty, "out": empty}, sig, None, deadline,
                          leaders_only=comm.mode == "hierarchical")
    if comm.mode == "hierarchical":
        shm.barrier(comm.arena, words, deadline, what)
