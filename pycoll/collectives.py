"""Collectives on flat tensors: bind buffers and a signature, pick the schedule, run it.

Each function takes already validated, flat, contiguous 1-D tensors (the c10d layer does
the validation and any reshaping) and ends with ``seq, deadline`` so that the communicator
can call it as a task. The signature that travels in every frame header is built here.
"""

from __future__ import annotations

import torch

from .reduce_ops import Reduction
from .wire import Signature


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def all_reduce(comm, t: torch.Tensor, red: Reduction, seq: int, deadline: float) -> None:
    red.prepare(t)
    sig = Signature("all_reduce", seq, dtype_name(t.dtype), t.numel(), red.name)
    comm.run_schedule("all_reduce", t.nbytes, (t.numel(),), {"in": t, "out": t}, sig, red, deadline)
    red.finish(t)


def broadcast(comm, t: torch.Tensor, root: int, seq: int, deadline: float) -> None:
    sig = Signature("broadcast", seq, dtype_name(t.dtype), t.numel(), root=root)
    comm.run_schedule("broadcast", t.nbytes, (t.numel(), root), {"in": t, "out": t}, sig, None, deadline)


def reduce(comm, t: torch.Tensor, root: int, red: Reduction, seq: int, deadline: float) -> None:
    # Non-root inputs stay untouched: a PREMUL_SUM factor is applied to a copy.
    src = t
    if red.factor is not None:
        src = t.clone()
        red.prepare(src)
    sig = Signature("reduce", seq, dtype_name(t.dtype), t.numel(), red.name, root)
    comm.run_schedule("reduce", t.nbytes, (t.numel(), root), {"in": src, "out": src if comm.rank == root else t},
                      sig, red, deadline)
    if comm.rank == root:
        if src is not t:
            t.copy_(src)
        red.finish(t)


def all_gather(comm, out: torch.Tensor, inp: torch.Tensor, seq: int, deadline: float) -> None:
    sig = Signature("all_gather", seq, dtype_name(inp.dtype), inp.numel())
    comm.run_schedule("all_gather", out.nbytes, (inp.numel(),), {"in": inp, "out": out}, sig, None, deadline)


def gather(comm, out: torch.Tensor | None, inp: torch.Tensor, root: int, seq: int, deadline: float) -> None:
    sig = Signature("gather", seq, dtype_name(inp.dtype), inp.numel(), root=root)
    bufs = {"in": inp, "out": out if out is not None else inp[:0]}
    comm.run_schedule("gather", inp.nbytes * comm.world, (inp.numel(), root), bufs, sig, None, deadline)


def scatter(comm, out: torch.Tensor, inp: torch.Tensor | None, root: int, seq: int, deadline: float) -> None:
    sig = Signature("scatter", seq, dtype_name(out.dtype), out.numel(), root=root)
    bufs = {"in": inp if inp is not None else out[:0], "out": out}
    comm.run_schedule("scatter", out.nbytes * comm.world, (out.numel(), root), bufs, sig, None, deadline)


def reduce_scatter(comm, out: torch.Tensor, inp: torch.Tensor, counts: tuple[int, ...], red: Reduction,
                   seq: int, deadline: float) -> None:
    if red.factor is not None:
        inp = inp.clone()
        red.prepare(inp)
    sig = Signature("reduce_scatter", seq, dtype_name(inp.dtype), inp.numel(), red.name)
    comm.run_schedule("reduce_scatter", inp.nbytes, (counts,), {"in": inp, "out": out}, sig, red, deadline)
    red.finish(out)


def all_to_all(comm, out: torch.Tensor, inp: torch.Tensor, send_counts: tuple[int, ...],
               recv_counts: tuple[int, ...], seq: int, deadline: float) -> None:
    # numel in the signature is the total sent, the one figure both sides of every pair
    # cannot check directly; per-pair sizes are checked by each frame's byte count.
    sig = Signature("all_to_all", seq, dtype_name(inp.dtype), comm.world)
    comm.run_schedule("all_to_all", inp.nbytes, (send_counts, recv_counts), {"in": inp, "out": out},
                      sig, None, deadline)


def barrier(comm, seq: int, deadline: float) -> None:
    empty = torch.empty(0, dtype=torch.uint8)
    sig = Signature("barrier", seq, "uint8", 0)
    comm.run_schedule("barrier", 0, (), {"in": empty, "out": empty}, sig, None, deadline)
