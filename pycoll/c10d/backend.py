"""The c10d backend: torch.distributed's ProcessGroup surface on top of a Communicator.

Thin on purpose: every method validates its arguments before any I/O (dtype, device,
layout, list lengths, sizes, roots, ops), reshapes to flat contiguous tensors, submits a
task to the group's communicator and returns a Work. Whatever a rank can check alone is
checked here; what needs the other ranks (sizes, ops, roots agreeing) travels in the
frame headers and is checked by the transport.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll import observe, rendezvous
from pycoll.c10d import sparse
from pycoll.c10d.p2p import PointToPoint
from pycoll.c10d.plans import (
    check_outputs,
    check_root,
    check_tensor,
    check_tensors,
    flat,
    flat_in,
    flat_out,
    no_write_back,
    same_dtype,
    unflatten_into,
)
from pycoll.core import collectives as C
from pycoll.core.communicator import Communicator
from pycoll.core.reductions import make_reduction
from pycoll.core.work import Work, completed
from pycoll.cuda.dispatch import install as _install_cuda_dispatch
from pycoll.cuda.paths import backend_devices


@dataclass
class Options:
    """What c10d copies from a parent group's backend into a split (``backend.options``)."""

    _timeout: timedelta


# send, recv, recv_anysource and monitored_barrier come from PointToPoint (pycoll/torch_p2p.py).
class ProcessGroupPycoll(PointToPoint, dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout = timeout
        # This generation's keys only; CUDA calls and splits exchange their set-up through it.
        self._store = store = rendezvous.generation_store(store, rank)
        self._comm = Communicator(store, rank, size, timeout.total_seconds(), observers=observe.for_group(rank))
        self._mb_count = 0

    @property
    def communicator(self) -> Communicator:
        """The engine of this group (``pycoll.core.communicator``)."""
        return self._comm

    # -- identity ----------------------------------------------------------------------
    is_pycoll = True   # how torch_compat's wrappers tell a pycoll group from others

    def getBackendName(self) -> str:
        return "pycoll"

    def name(self) -> str:
        return "pycoll"

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"ProcessGroupPycoll(rank={self._rank}, size={self._size})"

    # c10d keeps a group's name and description on its backends; this class is its own
    # backend, so it keeps them itself (torch calls these through its C++ trampoline).
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    # -- the per-device backend lookups (docs/c10d.md) -------------------------------------
    # torch finds a group's backend per device (``pg._get_backend(device)``) and asks it what
    # it supports. A C++ Backend cannot be made from Python, and torch uses a ProcessGroup
    # subclass as the group itself, so the group answers for its devices.
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in backend_devices(torch.version.cuda is not None)]

    def _get_backend(self, device) -> "ProcessGroupPycoll":
        kind = torch.device(device).type
        if kind not in backend_devices(torch.version.cuda is not None):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    supports_splitting = True
    supports_coalescing = False

    @property
    def supports_shrinking(self) -> bool:
        return hasattr(self, "shrink")

    @property
    def options(self) -> Options:
        return Options(self._timeout)

    def get_group_store(self):
        return self._store

    def _set_sequence_number_for_group(self) -> None:
        """c10d asks gloo and nccl to agree on a first sequence number; ours start at 0."""

    def _set_default_timeout(self, timeout: timedelta) -> None:
        """The timeout of every later op (``dist.distributed_c10d._set_pg_timeout``)."""
        self._timeout = timeout
        self._comm.timeout = timeout.total_seconds()

    def eager_connect_single_device(self, device=None) -> None:
        """Connections are made at construction: nothing is left to connect."""

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    device_types=None):
        """A new group of the parent-group ranks ``ranks`` (c10d's ``ProcessGroup.split_group``).

        Called by every rank of this group with the split it belongs to; ranks outside
        ``ranks`` get None. The members meet through this group's store, under the split's
        name (c10d gives each split a unique one).
        """
        ranks = sorted(int(r) for r in ranks)
        if self._rank not in ranks:
            return None
        if timeout is None:
            timeout = opts._timeout if isinstance(opts, Options) else self._timeout
        name = group_name or f"split-{'-'.join(map(str, ranks))}"
        store = dist.PrefixStore(f"pycoll/split/{name}/", self._store)
        pg = ProcessGroupPycoll(store, ranks.index(self._rank), len(ranks), timeout)
        pg._set_group_name(name)
        pg._set_group_desc(group_desc or f"{self.getGroupDesc()}:split")
        return pg

    def _submit(self, op: str, outputs: list, task, opts=None) -> Work:
        return self._comm.submit(op, outputs, task, not getattr(opts, "asyncOp", True),
                                 _op_timeout(opts))

    # -- reductions ----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        if len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
            return self._sparse_allreduce(tensors[0], opts)
        (t,) = check_tensors(tensors, "allreduce", exactly=1)
        red = make_reduction(opts.reduceOp, t.dtype, self._size)
        f, back = flat(t, "allreduce")
        task = C.all_reduce_task(self._comm, f, red)
        return self._submit("all_reduce", [t], task if back is no_write_back else _then(task, back), opts)

    def _sparse_allreduce(self, t, opts):
        red = make_reduction(opts.reduceOp, t.dtype, self._size)
        sparse.check(t, red, "allreduce")
        return self._submit("all_reduce", [t], functools.partial(sparse.all_reduce, self._comm, t), opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        ts = check_outputs(tensors, "allreduce_coalesced")
        dtype = same_dtype(ts, "allreduce_coalesced")
        red = make_reduction(opts.reduceOp, dtype, self._size)

        def task(seq, deadline):
            buf = torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0, dtype=dtype)
            C.all_reduce(self._comm, buf, red, seq, deadline)
            unflatten_into(buf, ts)
        return self._submit("all_reduce", list(ts), task, opts)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        (t,) = check_tensors(tensors, "reduce", exactly=1)
        root = check_root(opts.rootRank, self._size, "reduce")
        red = make_reduction(opts.reduceOp, t.dtype, self._size)
        f, back = flat(t, "reduce")

        def task(seq, deadline):
            C.reduce(self._comm, f, root, red, seq, deadline)
            back()
        return self._submit("reduce", [t], task, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        (out,) = check_tensors(output_tensors, "reduce_scatter output", exactly=1)
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise ValueError(f"reduce_scatter: input list must hold {self._size} tensors (one per rank)")
        ins = check_tensors(input_tensors[0], "reduce_scatter input")
        same_dtype([out, *ins], "reduce_scatter")
        if ins[self._rank].numel() != out.numel():
            raise ValueError(f"reduce_scatter: output has {out.numel()} elements but input "
                             f"{self._rank} has {ins[self._rank].numel()}")
        red = make_reduction(opts.reduceOp, out.dtype, self._size)
        counts = tuple(x.numel() for x in ins)
        o, back = flat_out(out, "reduce_scatter output")

        def task(seq, deadline):
            inp = torch.cat([x.reshape(-1) for x in ins])
            C.reduce_scatter(self._comm, o, inp, counts, red, seq, deadline)
            back()
        return self._submit("reduce_scatter", [out], task, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        out, inp = check_tensor(output, "reduce_scatter output"), check_tensor(input, "reduce_scatter input")
        same_dtype([out, inp], "reduce_scatter_tensor")
        if inp.numel() != out.numel() * self._size:
            raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                             f"output size x world size = {out.numel() * self._size}")
        red = make_reduction(opts.reduceOp, out.dtype, self._size)
        o, back = flat_out(out, "reduce_scatter_tensor output")
        i = flat_in(inp)
        counts = (out.numel(),) * self._size

        def task(seq, deadline):
            C.reduce_scatter(self._comm, o, i, counts, red, seq, deadline)
            back()
        return self._submit("reduce_scatter", [out], task, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self.reduce_scatter_single, outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        (t,) = check_tensors(tensors, "broadcast", exactly=1)
        root = check_root(opts.rootRank, self._size, "broadcast")
        f, back = flat(t, "broadcast")

        def task(seq, deadline):
            C.broadcast(self._comm, f, root, seq, deadline)
            back()
        return self._submit("broadcast", [t], task, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        (inp,) = check_tensors(input_tensors, "allgather input", exactly=1)
        if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
            raise ValueError(f"allgather: output list must hold {self._size} tensors (one per rank)")
        outs = check_outputs(output_tensors[0], "allgather output")
        self._check_parts(outs, inp, "allgather")
        i = flat_in(inp)

        def task(seq, deadline):
            buf = torch.empty(inp.numel() * self._size, dtype=inp.dtype)
            C.all_gather(self._comm, buf, i, seq, deadline)
            unflatten_into(buf, outs)
        return self._submit("all_gather", outs, task, opts)

    def all_gather_single(self, output, input, opts=None):
        out, inp = check_tensor(output, "all_gather output"), check_tensor(input, "all_gather input")
        same_dtype([out, inp], "all_gather_into_tensor")
        if out.numel() != inp.numel() * self._size:
            raise ValueError(f"all_gather_into_tensor: output has {out.numel()} elements, expected "
                             f"input size x world size = {inp.numel() * self._size}")
        o, back = flat_out(out, "all_gather_into_tensor output")
        i = flat_in(inp)

        def task(seq, deadline):
            C.all_gather(self._comm, o, i, seq, deadline)
            back()
        return self._submit("all_gather", [out], task, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self.all_gather_single, outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        ins = check_tensors(input_list, "allgather_coalesced input")
        dtype = same_dtype(ins, "allgather_coalesced")
        if len(output_lists) != self._size or any(len(o) != len(ins) for o in output_lists):
            raise ValueError(f"allgather_coalesced: output must be {self._size} lists of {len(ins)} tensors")
        for outs in output_lists:
            for o, i in zip(check_outputs(outs, "allgather_coalesced output"), ins):
                self._check_parts([o], i, "allgather_coalesced")
        n = sum(t.numel() for t in ins)

        def task(seq, deadline):
            send = torch.cat([t.reshape(-1) for t in ins]) if ins else torch.empty(0, dtype=dtype)
            buf = torch.empty(n * self._size, dtype=dtype)
            C.all_gather(self._comm, buf, send, seq, deadline)
            unflatten_into(buf, [o for outs in output_lists for o in outs])
        return self._submit("all_gather", [o for outs in output_lists for o in outs], task, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        (inp,) = check_tensors(input_tensors, "gather input", exactly=1)
        root = check_root(opts.rootRank, self._size, "gather")
        outs = []
        if self._rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
                raise ValueError(f"gather: the root's output list must hold {self._size} tensors")
            outs = check_outputs(output_tensors[0], "gather output")
            self._check_parts(outs, inp, "gather")
        elif output_tensors and any(output_tensors):
            raise ValueError("gather: non-root ranks must not pass output tensors")
        i = flat_in(inp)

        def task(seq, deadline):
            buf = torch.empty(inp.numel() * self._size, dtype=inp.dtype) if outs else None
            C.gather(self._comm, buf, i, root, seq, deadline)
            if outs:
                unflatten_into(buf, outs)
        return self._submit("gather", outs, task, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        (out,) = check_tensors(output_tensors, "scatter output", exactly=1)
        root = check_root(opts.rootRank, self._size, "scatter")
        ins = []
        if self._rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
                raise ValueError(f"scatter: the root's input list must hold {self._size} tensors")
            ins = check_tensors(input_tensors[0], "scatter input")
            self._check_parts(ins, out, "scatter")
        elif input_tensors and any(input_tensors):
            raise ValueError("scatter: non-root ranks must not pass input tensors")
        o, back = flat_out(out, "scatter output")

        def task(seq, deadline):
            buf = torch.cat([x.reshape(-1) for x in ins]) if ins else None
            C.scatter(self._comm, o, buf, root, seq, deadline)
            back()
        return self._submit("scatter", [out], task, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs = check_outputs(output_tensors, "alltoall output")
        ins = check_tensors(input_tensors, "alltoall input")
        if len(outs) != self._size or len(ins) != self._size:
            raise ValueError(f"alltoall: input and output lists must hold {self._size} tensors each")
        dtype = same_dtype([*outs, *ins], "alltoall")
        send_counts = tuple(t.numel() for t in ins)
        recv_counts = tuple(t.numel() for t in outs)
        self._check_own_block(send_counts, recv_counts, "alltoall")

        def task(seq, deadline):
            send = torch.cat([t.reshape(-1) for t in ins])
            recv = torch.empty(sum(recv_counts), dtype=dtype)
            C.all_to_all(self._comm, recv, send, send_counts, recv_counts, seq, deadline)
            unflatten_into(recv, outs)
        return self._submit("all_to_all", outs, task, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        out, inp = check_tensor(output, "all_to_all output"), check_tensor(input, "all_to_all input")
        same_dtype([out, inp], "all_to_all_single")
        send_counts = _split_counts(inp, input_split_sizes, self._size, "input")
        recv_counts = _split_counts(out, output_split_sizes, self._size, "output")
        self._check_own_block(send_counts, recv_counts, "all_to_all_single")
        o, back = flat_out(out, "all_to_all_single output")
        i = flat_in(inp)

        def task(seq, deadline):
            C.all_to_all(self._comm, o, i, send_counts, recv_counts, seq, deadline)
            back()
        return self._submit("all_to_all", [out], task, opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._submit("barrier", [], functools.partial(C.barrier, self._comm), opts)

    # -- lifecycle -----------------------------------------------------------------------
    def shutdown(self) -> None:
        self._comm.shutdown()

    def abort(self) -> None:
        self._comm.shutdown(abort=True)

    # -- helpers -------------------------------------------------------------------------
    def _check_parts(self, parts, ref, op: str) -> None:
        for p in parts:
            if p.dtype != ref.dtype:
                raise TypeError(f"{op}: dtype {p.dtype} does not match {ref.dtype}")
            if p.numel() != ref.numel():
                raise ValueError(f"{op}: tensor of {p.numel()} elements where {ref.numel()} were expected")

    def _check_own_block(self, send_counts, recv_counts, op: str) -> None:
        """The block a rank sends itself is the one it receives from itself."""
        if send_counts[self._rank] != recv_counts[self._rank]:
            raise ValueError(f"{op}: rank {self._rank} sends {send_counts[self._rank]} elements to "
                             f"itself but expects {recv_counts[self._rank]} from itself")

    def _coalesced(self, fn, outputs, inputs, opts) -> Work:
        if len(outputs) != len(inputs):
            raise ValueError("coalesced collective: output and input lists differ in length")
        works = [fn(o, i, opts) for o, i in zip(outputs, inputs)]
        if not works:
            return completed("coalesced", [])
        return works[-1]  # ops complete in issue order, so the last one finishing covers all


def _then(task, after):
    """``task``, then ``after()`` (a write-back into a non-contiguous tensor)."""
    def run(seq: int, deadline: float) -> None:
        task(seq, deadline)
        after()
    return run


def _op_timeout(opts) -> float | None:
    """Seconds of ``opts.timeout`` when the caller set one; None for c10d's unset (-1 ms) or 0."""
    t = getattr(opts, "timeout", None)
    secs = t.total_seconds() if t is not None else 0.0
    return secs if secs > 0 else None


def _split_counts(t: torch.Tensor, splits, world: int, what: str) -> tuple[int, ...]:
    if t.dim() == 0:
        raise ValueError(f"all_to_all_single: {what} must have at least one dimension")
    row = t.numel() // t.size(0) if t.size(0) else 0
    if not splits:
        if t.size(0) % world:
            raise ValueError(f"all_to_all_single: {what} dim 0 ({t.size(0)}) is not divisible by the "
                             f"world size {world}; pass split sizes")
        return (t.size(0) // world * row,) * world
    splits = list(splits)
    if len(splits) != world or any(s < 0 for s in splits):
        raise ValueError(f"all_to_all_single: {what} split sizes must be {world} non-negative ints")
    if sum(splits) != t.size(0):
        raise ValueError(f"all_to_all_single: {what} split sizes sum to {sum(splits)} but dim 0 is {t.size(0)}")
    return tuple(s * row for s in splits)


def create(store, rank: int, size: int, timeout: timedelta) -> ProcessGroupPycoll:
    """The creator function torch.distributed calls for backend="pycoll"."""
    return ProcessGroupPycoll(store, rank, size, timeout)


# Calls with CUDA tensors go to pycoll/cuda (nccl, ipc or host staging) before the CPU path.
_install_cuda_dispatch(ProcessGroupPycoll)
