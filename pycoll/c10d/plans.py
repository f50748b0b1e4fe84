"""What a c10d call becomes before it runs: a ``Plan``, the same for CPU and CUDA tensors.

Each builder takes a ProcessGroup method's arguments (and this rank and the world size),
checks everything a rank can check alone (``checks``), and returns which *primitive* runs
(``all_reduce(t, red)``, ``broadcast(t, root)``, ``reduce(t, root, red)``,
``all_gather(out, inp)``, ``gather(out | None, inp, root)``, ``scatter(out, inp | None,
root)``, ``reduce_scatter(out, inp, counts, red)``, ``all_to_all(out, inp, send, recv)``,
``barrier()``, ``send(t, peer)``, ``recv(t, peer)``) on which flat contiguous tensors, and
what to do afterwards (copy results into the caller's tensors). The CPU channel runs the
primitive of ``core.collectives`` with this rank's communicator; the CUDA channel runs its
path's primitive of the same name on the caller's stream (``pycoll.cuda``).

``args`` is either the primitive's arguments or, for list-form calls that must pack their
tensors, a function making them when the op runs (not when it is submitted: an async op
reads its inputs when its turn comes, as with gloo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from pycoll.c10d import sparse
from pycoll.c10d.checks import (
    cat,
    check_outputs,
    check_own_block,
    check_parts,
    check_peer,
    check_root,
    check_tensor,
    check_tensors,
    device_of,
    flat,
    flat_in,
    flat_out,
    no_write_back,
    plain_cpu,
    same_dtype,
    split_counts,
    unflatten_into,
)
from pycoll.core.reductions import Reduction, make_reduction
from pycoll.transport.tcp.p2p import ANY


@dataclass(slots=True)
class Plan:
    op: str                           # the primitive (see the module docstring)
    outputs: list                     # what the Work hands back
    device: torch.device | None       # where the call's tensors live (None: it has none)
    args: tuple | Callable[[], tuple]
    finish: Callable[[], None] = no_write_back
    red: Reduction | None = None      # (for the CUDA paths, which check what they can reduce)
    tag: int = 0                      # point to point only

    def arguments(self) -> tuple:
        return self.args() if callable(self.args) else self.args


def _one(tensors, what: str) -> torch.Tensor:
    (t,) = check_tensors(tensors, what, exactly=1)
    return t


# -- reductions ------------------------------------------------------------------------------
_CPU = torch.device("cpu")


def latency_allreduce(world: int, tensors, opts) -> tuple | None:
    """The latency path (every small all_reduce, every DDP bucket): for one plain CPU tensor,
    the primitive's arguments ``(flat, red)`` without a Plan; None for anything else, which
    ``allreduce`` checks in full. A Plan and the checks' calls cost a small op a tenth."""
    if len(tensors) == 1:
        t = tensors[0]
        if plain_cpu(t):
            return (t if t.dim() == 1 else t.view(-1)), make_reduction(opts.reduceOp, t.dtype, world)
    return None


def allreduce(rank: int, world: int, tensors, opts) -> Plan:
    fast = latency_allreduce(world, tensors, opts)
    if fast is not None:
        return Plan("all_reduce", [tensors[0]], _CPU, fast, no_write_back, fast[1])
    if len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
        t = tensors[0]
        red = make_reduction(opts.reduceOp, t.dtype, world)
        sparse.check(t, red, "allreduce")
        return Plan("sparse_all_reduce", [t], t.device, (t,), red=red)
    t = _one(tensors, "allreduce")
    red = make_reduction(opts.reduceOp, t.dtype, world)
    f, back = flat(t, "allreduce")
    return Plan("all_reduce", [t], t.device, (f, red), back, red)


def allreduce_coalesced(rank: int, world: int, tensors, opts) -> Plan:
    ts = check_outputs(tensors, "allreduce_coalesced")
    dtype = same_dtype(ts, "allreduce_coalesced")
    red = make_reduction(opts.reduceOp, dtype, world)
    device = device_of(ts, "allreduce_coalesced")
    buf: list = []

    def args():
        buf[:] = [cat(ts, dtype, device)]
        return buf[0], red
    return Plan("all_reduce", list(ts), device, args, lambda: unflatten_into(buf[0], ts), red)


def reduce(rank: int, world: int, tensors, opts) -> Plan:
    t = _one(tensors, "reduce")
    root = check_root(opts.rootRank, world, "reduce")
    red = make_reduction(opts.reduceOp, t.dtype, world)
    f, back = flat(t, "reduce")
    return Plan("reduce", [t], t.device, (f, root, red), back, red)


def reduce_scatter(rank: int, world: int, output_tensors, input_tensors, opts) -> Plan:
    out = _one(output_tensors, "reduce_scatter output")
    if len(input_tensors) != 1 or len(input_tensors[0]) != world:
        raise ValueError(f"reduce_scatter: input list must hold {world} tensors (one per rank)")
    ins = check_tensors(input_tensors[0], "reduce_scatter input")
    same_dtype([out, *ins], "reduce_scatter")
    device = device_of([out, *ins], "reduce_scatter")
    if ins[rank].numel() != out.numel():
        raise ValueError(f"reduce_scatter: output has {out.numel()} elements but input "
                         f"{rank} has {ins[rank].numel()}")
    red = make_reduction(opts.reduceOp, out.dtype, world)
    counts = tuple(x.numel() for x in ins)
    o, back = flat_out(out, "reduce_scatter output")
    return Plan("reduce_scatter", [out], device, lambda: (o, cat(ins, out.dtype, device), counts, red), back, red)


def reduce_scatter_single(rank: int, world: int, output, input, opts) -> Plan:
    out, inp = check_tensor(output, "reduce_scatter output"), check_tensor(input, "reduce_scatter input")
    same_dtype([out, inp], "reduce_scatter_tensor")
    device = device_of([out, inp], "reduce_scatter_tensor")
    if inp.numel() != out.numel() * world:
        raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                         f"output size x world size = {out.numel() * world}")
    red = make_reduction(opts.reduceOp, out.dtype, world)
    o, back = flat_out(out, "reduce_scatter_tensor output")
    return Plan("reduce_scatter", [out], device, (o, flat_in(inp), (out.numel(),) * world, red), back, red)


# -- data movement ---------------------------------------------------------------------------
def broadcast(rank: int, world: int, tensors, opts) -> Plan:
    t = _one(tensors, "broadcast")
    root = check_root(opts.rootRank, world, "broadcast")
    f, back = flat(t, "broadcast")
    return Plan("broadcast", [t], t.device, (f, root), back)


def allgather(rank: int, world: int, output_tensors, input_tensors, opts=None) -> Plan:
    inp = _one(input_tensors, "allgather input")
    if len(output_tensors) != 1 or len(output_tensors[0]) != world:
        raise ValueError(f"allgather: output list must hold {world} tensors (one per rank)")
    outs = check_outputs(output_tensors[0], "allgather output")
    check_parts(outs, inp, "allgather")
    device = device_of([inp, *outs], "allgather")
    i = flat_in(inp)
    buf = torch.empty(inp.numel() * world, dtype=inp.dtype, device=device)
    return Plan("all_gather", outs, device, (buf, i), lambda: unflatten_into(buf, outs))


def all_gather_single(rank: int, world: int, output, input, opts=None) -> Plan:
    out, inp = check_tensor(output, "all_gather output"), check_tensor(input, "all_gather input")
    same_dtype([out, inp], "all_gather_into_tensor")
    device = device_of([out, inp], "all_gather_into_tensor")
    if out.numel() != inp.numel() * world:
        raise ValueError(f"all_gather_into_tensor: output has {out.numel()} elements, expected "
                         f"input size x world size = {inp.numel() * world}")
    o, back = flat_out(out, "all_gather_into_tensor output")
    return Plan("all_gather", [out], device, (o, flat_in(inp)), back)


def allgather_coalesced(rank: int, world: int, output_lists, input_list, opts=None) -> Plan:
    ins = check_tensors(input_list, "allgather_coalesced input")
    dtype = same_dtype(ins, "allgather_coalesced")
    if len(output_lists) != world or any(len(o) != len(ins) for o in output_lists):
        raise ValueError(f"allgather_coalesced: output must be {world} lists of {len(ins)} tensors")
    for outs in output_lists:
        for o, i in zip(check_outputs(outs, "allgather_coalesced output"), ins):
            check_parts([o], i, "allgather_coalesced")
    flat_outs = [o for outs in output_lists for o in outs]
    device = device_of([*ins, *flat_outs], "allgather_coalesced") if ins else torch.device("cpu")
    buf = torch.empty(sum(t.numel() for t in ins) * world, dtype=dtype, device=device)
    return Plan("all_gather", flat_outs, device, lambda: (buf, cat(ins, dtype, device)),
                lambda: unflatten_into(buf, flat_outs))


def _root_list(rank: int, root: int, lists, world: int, op: str, role: str, check) -> list:
    """The root's list of ``world`` tensors, checked; non-root ranks must pass none."""
    if rank != root:
        if lists and any(lists):
            raise ValueError(f"{op}: non-root ranks must not pass {role} tensors")
        return []
    if len(lists) != 1 or len(lists[0]) != world:
        raise ValueError(f"{op}: the root's {role} list must hold {world} tensors")
    return check(lists[0], f"{op} {role}")


def gather(rank: int, world: int, output_tensors, input_tensors, opts) -> Plan:
    inp = _one(input_tensors, "gather input")
    root = check_root(opts.rootRank, world, "gather")
    outs = _root_list(rank, root, output_tensors, world, "gather", "output", check_outputs)
    if outs:
        check_parts(outs, inp, "gather")
    device = device_of([inp, *outs], "gather")
    buf = torch.empty(inp.numel() * world, dtype=inp.dtype, device=device) if outs else None
    return Plan("gather", outs, device, (buf, flat_in(inp), root),
                (lambda: unflatten_into(buf, outs)) if outs else no_write_back)


def scatter(rank: int, world: int, output_tensors, input_tensors, opts) -> Plan:
    out = _one(output_tensors, "scatter output")
    root = check_root(opts.rootRank, world, "scatter")
    ins = _root_list(rank, root, input_tensors, world, "scatter", "input", check_tensors)
    if ins:
        check_parts(ins, out, "scatter")
    device = device_of([out, *ins], "scatter")
    o, back = flat_out(out, "scatter output")
    return Plan("scatter", [out], device, lambda: (o, cat(ins, out.dtype, device) if ins else None, root), back)


def alltoall(rank: int, world: int, output_tensors, input_tensors, opts=None) -> Plan:
    outs = check_outputs(output_tensors, "alltoall output")
    ins = check_tensors(input_tensors, "alltoall input")
    if len(outs) != world or len(ins) != world:
        raise ValueError(f"alltoall: input and output lists must hold {world} tensors each")
    dtype = same_dtype([*outs, *ins], "alltoall")
    device = device_of([*outs, *ins], "alltoall")
    send_counts, recv_counts = tuple(t.numel() for t in ins), tuple(t.numel() for t in outs)
    check_own_block(send_counts, recv_counts, rank, "alltoall")
    recv = torch.empty(sum(recv_counts), dtype=dtype, device=device)
    return Plan("all_to_all", outs, device, lambda: (recv, cat(ins, dtype, device), send_counts, recv_counts),
                lambda: unflatten_into(recv, outs))


def all_to_all_single(rank: int, world: int, output, input, output_split_sizes, input_split_sizes,
                      opts=None) -> Plan:
    out, inp = check_tensor(output, "all_to_all output"), check_tensor(input, "all_to_all input")
    same_dtype([out, inp], "all_to_all_single")
    device = device_of([out, inp], "all_to_all_single")
    send_counts = split_counts(inp, input_split_sizes, world, "input")
    recv_counts = split_counts(out, output_split_sizes, world, "output")
    check_own_block(send_counts, recv_counts, rank, "all_to_all_single")
    o, back = flat_out(out, "all_to_all_single output")
    return Plan("all_to_all", [out], device, (o, flat_in(inp), send_counts, recv_counts), back)


def barrier(rank: int, world: int, opts=None) -> Plan:
    ids = list(getattr(opts, "device_ids", None) or []) if opts is not None else []
    device = torch.device("cuda", ids[0]) if ids else None   # dist.barrier(device_ids=[i])
    return Plan("barrier", [], device, ())


# -- point to point ------------------------------------------------------------------------------
def send(rank: int, world: int, tensors, dst_rank: int, tag: int = 0) -> Plan:
    t = _one(tensors, "send")
    return Plan("send", [t], t.device, (flat_in(t), check_peer(dst_rank, rank, world, "send")), tag=tag)


def recv(rank: int, world: int, tensors, src_rank: int, tag: int = 0) -> Plan:
    t = _one(tensors, "recv")
    peer = check_peer(src_rank, rank, world, "recv")
    o, back = flat_out(t, "recv")
    return Plan("recv", [t], t.device, (o, peer), back, tag=tag)


def recv_anysource(rank: int, world: int, tensors, tag: int = 0) -> Plan:
    t = _one(tensors, "recv")
    o, back = flat_out(t, "recv")
    return Plan("recv", [t], t.device, (o, ANY), back, tag=tag)


OPTIONS = {allreduce: dist.AllreduceOptions, allreduce_coalesced: dist.AllreduceCoalescedOptions,
           reduce: dist.ReduceOptions, reduce_scatter: dist.ReduceScatterOptions,
           reduce_scatter_single: dist.ReduceScatterOptions, broadcast: dist.BroadcastOptions,
           gather: dist.GatherOptions, scatter: dist.ScatterOptions}
