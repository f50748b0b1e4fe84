"""The c10d methods for CUDA tensors: validate, reshape, run a path's primitive on the stream.

``CudaChannel`` is created for a process group at its first call with a CUDA tensor. That first
call is collective (every rank makes its CUDA calls in the same order, as with NCCL): each rank
publishes its facts through the group's Store (host, GPU, what it can import, the path it asks
for), every rank runs the same pure ``paths.choose_path`` on the same list, and the chosen path
is built (the NCCL communicator, or the IPC buffers and events).

After that, each call runs in the calling thread: arguments are checked before any
communication, the primitive is enqueued on the caller's *current* stream (captured when the
call is made) and a ``CudaWork`` is returned that holds an event recorded after it. The staging
path (and point-to-point calls on the ipc path) hands the call to the CPU method instead
(``staging.run``).

Primitives of a path, on flat contiguous 1-D tensors, run with the device and stream current:
all_reduce(t, red), broadcast(t, root), reduce(t, root, red), all_gather(out, inp),
gather(out | None, inp, root), scatter(out, inp | None, root), reduce_scatter(out, inp, counts, red),
all_to_all(out, inp, send_counts, recv_counts), barrier(), send(t, peer), recv(t, peer).
"""

from __future__ import annotations

import json
import logging
import threading

import torch
import torch.distributed as dist

from pycoll import rendezvous
from pycoll.c10d.plans import check_root, flat, flat_in, same_dtype
from pycoll.core.reductions import make_reduction
from pycoll.cuda import paths, staging
from pycoll.cuda.checks import (
    _parts,
    check_all,
    check_cuda,
    common_device,
    flat_out,
    local_facts,
)
from pycoll.cuda.work import CudaWork
from pycoll.errors import PycollError

log = logging.getLogger("pycoll")

P2P = ("send", "recv", "recv_anysource")


class CudaChannel:
    """The CUDA side of one ProcessGroupPycoll (see the module docstring)."""

    def __init__(self, pg) -> None:
        self.pg, self.rank, self.world = pg, pg.rank(), pg.size()
        self.timeout = pg._timeout.total_seconds()
        self.path: str | None = None
        self.impl = None
        self.device: torch.device | None = None
        self.facts: list[paths.RankFacts] = []
        self.error: BaseException | None = None
        self._attempts = 0
        self._lock = threading.RLock()

    # -- set-up ------------------------------------------------------------------------------
    def _init(self, device: torch.device) -> None:
        self._attempts += 1
        gr = dist.get_rank() if dist.is_initialized() else self.rank
        mine = local_facts(device, gr)
        key = f"pycoll/cuda/facts/{self._attempts}"
        got = rendezvous.exchange_all(self.pg._store, key, self.rank, self.world, json.dumps(mine.to_json()))
        facts = [paths.RankFacts.from_json(json.loads(v)) for v in got]
        path = paths.choose_path(facts)  # same list everywhere: same path or same error everywhere
        if path == "nccl":
            from pycoll.cuda.nccl import NcclPath
            impl = NcclPath(self.pg._store, self.rank, self.world, device)
        elif path == "ipc":
            from pycoll.cuda.ipc import IpcPath
            impl = IpcPath(self.pg._store, self.rank, self.world, device, self.timeout, facts)
        else:
            impl = None
            if not mine.nccl and self.world > 1 and len({(f.host, f.gpu) for f in facts}) == self.world:
                log.info("pycoll: CUDA tensors take host staging; %s", paths.cuda_hint(path="nccl"))
        self.path, self.impl, self.device, self.facts = path, impl, device, facts
        log.info("pycoll rank %d: CUDA path %s", self.rank, paths.explain(facts))

    def close(self, abort: bool = False) -> None:
        with self._lock:
            if self.impl is not None:
                self.impl.close(abort)
            self.impl = None

    def sync_device(self) -> None:
        """Before a host barrier: this rank's CUDA work so far has finished."""
        if self.device is not None:
            torch.cuda.current_stream(self.device).synchronize()

    # -- calls -------------------------------------------------------------------------------
    def call(self, name: str, method, args: tuple, kwargs: dict, device: torch.device | None = None):
        device = device or common_device(args[:2], name)
        with self._lock:
            if self.path is None:
                self._init(device)
            elif device != self.device:
                raise ValueError(f"{name}: this group's CUDA tensors live on {self.device}, got {device} "
                                 f"(one device per rank and group)")
            stream = torch.cuda.current_stream(device)
            if self.path == "staging" or (self.path == "ipc" and name in P2P):
                return staging.run(self.pg, name, method, args, kwargs, device, stream)
            if self.error is not None:
                raise PycollError(f"{name}: the CUDA {self.path} path is unusable after an earlier "
                                  f"error: {self.error}")
            if name == "recv_anysource":
                raise ValueError("recv from any source is not supported on the nccl path "
                                 "(as with torch's NCCL backend)")
            return getattr(self, name)(device, stream, *args, **kwargs)

    def _run(self, op, device, stream, outputs, fn, source: int = -1) -> CudaWork:
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            try:
                fn()
            except BaseException as exc:
                if getattr(exc, "before_io", False) or isinstance(exc, (ValueError, TypeError)):
                    raise
                self.error = exc
                self.impl.abort_peers(str(exc))
                raise
            event = torch.cuda.Event()
            event.record(stream)
        return CudaWork(op, outputs, event, device, source)

    def _red(self, opts, dtype):
        red = make_reduction(opts.reduceOp, dtype, self.world)
        self.impl.check_reduction(dtype, red)
        return red

    # -- reductions --------------------------------------------------------------------------
    def allreduce(self, device, stream, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        (t,) = check_all(tensors, "allreduce", exactly=1)
        red = self._red(opts, t.dtype)

        def fn():
            f, back = flat(t, "cuda")
            self.impl.all_reduce(f, red)
            back()
        return self._run("all_reduce", device, stream, [t], fn)

    def allreduce_coalesced(self, device, stream, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        ts = check_all(tensors, "allreduce_coalesced")
        dtype = same_dtype(ts, "allreduce_coalesced")
        red = self._red(opts, dtype) if ts else None

        def fn():
            if not ts:
                return
            buf = torch.cat([t.reshape(-1) for t in ts])
            self.impl.all_reduce(buf, red)
            off = 0
            for t in ts:
                t.copy_(buf[off:off + t.numel()].view_as(t))
                off += t.numel()
        return self._run("all_reduce", device, stream, list(ts), fn)

    def reduce(self, device, stream, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        (t,) = check_all(tensors, "reduce", exactly=1)
        root = check_root(opts.rootRank, self.world, "reduce")
        red = self._red(opts, t.dtype)

        def fn():
            f, back = flat(t, "cuda")
            self.impl.reduce(f, root, red)
            back()
        return self._run("reduce", device, stream, [t], fn)

    def reduce_scatter(self, device, stream, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        (out,) = check_all(output_tensors, "reduce_scatter output", exactly=1)
        if len(input_tensors) != 1 or len(input_tensors[0]) != self.world:
            raise ValueError(f"reduce_scatter: input list must hold {self.world} tensors (one per rank)")
        ins = check_all(input_tensors[0], "reduce_scatter input")
        same_dtype([out, *ins], "reduce_scatter")
        if ins[self.rank].numel() != out.numel():
            raise ValueError(f"reduce_scatter: output has {out.numel()} elements but input "
                             f"{self.rank} has {ins[self.rank].numel()}")
        red = self._red(opts, out.dtype)
        counts = tuple(x.numel() for x in ins)

        def fn():
            o, back = flat_out(out)
            self.impl.reduce_scatter(o, torch.cat([x.reshape(-1) for x in ins]), counts, red)
            back()
        return self._run("reduce_scatter", device, stream, [out], fn)

    def reduce_scatter_single(self, device, stream, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        out, inp = check_cuda(output, "reduce_scatter output"), check_cuda(input, "reduce_scatter input")
        same_dtype([out, inp], "reduce_scatter_tensor")
        if inp.numel() != out.numel() * self.world:
            raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                             f"output size x world size = {out.numel() * self.world}")
        red = self._red(opts, out.dtype)

        def fn():
            o, back = flat_out(out)
            i = flat_in(inp)
            self.impl.reduce_scatter(o, i, (out.numel(),) * self.world, red)
            back()
        return self._run("reduce_scatter", device, stream, [out], fn)

    # -- data movement -----------------------------------------------------------------------
    def broadcast(self, device, stream, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        (t,) = check_all(tensors, "broadcast", exactly=1)
        root = check_root(opts.rootRank, self.world, "broadcast")

        def fn():
            f, back = flat(t, "cuda")
            self.impl.broadcast(f, root)
            back()
        return self._run("broadcast", device, stream, [t], fn)

    def allgather(self, device, stream, output_tensors, input_tensors, opts=None):
        (inp,) = check_all(input_tensors, "allgather input", exactly=1)
        if len(output_tensors) != 1 or len(output_tensors[0]) != self.world:
            raise ValueError(f"allgather: output list must hold {self.world} tensors (one per rank)")
        outs = check_all(output_tensors[0], "allgather output")
        _parts(outs, inp, "allgather")

        def fn():
            n = inp.numel()
            buf = torch.empty(n * self.world, dtype=inp.dtype, device=device)
            self.impl.all_gather(buf, flat_in(inp))
            for r, o in enumerate(outs):
                o.copy_(buf[r * n:(r + 1) * n].view_as(o))
        return self._run("all_gather", device, stream, outs, fn)

    def all_gather_single(self, device, stream, output, input, opts=None):
        out, inp = check_cuda(output, "all_gather output"), check_cuda(input, "all_gather input")
        same_dtype([out, inp], "all_gather_into_tensor")
        if out.numel() != inp.numel() * self.world:
            raise ValueError(f"all_gather_into_tensor: output has {out.numel()} elements, expected "
                             f"input size x world size = {inp.numel() * self.world}")

        def fn():
            o, back = flat_out(out)
            self.impl.all_gather(o, flat_in(inp))
            back()
        return self._run("all_gather", device, stream, [out], fn)

    def allgather_coalesced(self, device, stream, output_lists, input_list, opts=None):
        ins = check_all(input_list, "allgather_coalesced input")
        dtype = same_dtype(ins, "allgather_coalesced")
        if len(output_lists) != self.world or any(len(o) != len(ins) for o in output_lists):
            raise ValueError(f"allgather_coalesced: output must be {self.world} lists of {len(ins)} tensors")
        for outs in output_lists:
            for o, i in zip(check_all(outs, "allgather_coalesced output"), ins):
                _parts([o], i, "allgather_coalesced")
        n = sum(t.numel() for t in ins)

        def fn():
            if not ins:
                return
            send = torch.cat([t.reshape(-1) for t in ins])
            buf = torch.empty(n * self.world, dtype=dtype, device=device)
            self.impl.all_gather(buf, send)
            for r, outs in enumerate(output_lists):
                off = r * n
                for o in outs:
                    o.copy_(buf[off:off + o.numel()].view_as(o))
                    off += o.numel()
        return self._run("all_gather", device, stream, [o for outs in output_lists for o in outs], fn)

    def gather(self, device, stream, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        (inp,) = check_all(input_tensors, "gather input", exactly=1)
        root = check_root(opts.rootRank, self.world, "gather")
        outs = []
        if self.rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self.world:
                raise ValueError(f"gather: the root's output list must hold {self.world} tensors")
            outs = check_all(output_tensors[0], "gather output")
            _parts(outs, inp, "gather")
        elif output_tensors and any(output_tensors):
            raise ValueError("gather: non-root ranks must not pass output tensors")

        def fn():
            n = inp.numel()
            buf = torch.empty(n * self.world, dtype=inp.dtype, device=device) if outs else None
            self.impl.gather(buf, flat_in(inp), root)
            for r, o in enumerate(outs):
                o.copy_(buf[r * n:(r + 1) * n].view_as(o))
        return self._run("gather", device, stream, outs, fn)

    def scatter(self, device, stream, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        (out,) = check_all(output_tensors, "scatter output", exactly=1)
        root = check_root(opts.rootRank, self.world, "scatter")
        ins = []
        if self.rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self.world:
                raise ValueError(f"scatter: the root's input list must hold {self.world} tensors")
            ins = check_all(input_tensors[0], "scatter input")
            _parts(ins, out, "scatter")
        elif input_tensors and any(input_tensors):
            raise ValueError("scatter: non-root ranks must not pass input tensors")

        def fn():
            o, back = flat_out(out)
            self.impl.scatter(o, torch.cat([x.reshape(-1) for x in ins]) if ins else None, root)
            back()
        return self._run("scatter", device, stream, [out], fn)

    def alltoall(self, device, stream, output_tensors, input_tensors, opts=None):
        outs = check_all(output_tensors, "alltoall output")
        ins = check_all(input_tensors, "alltoall input")
        if len(outs) != self.world or len(ins) != self.world:
            raise ValueError(f"alltoall: input and output lists must hold {self.world} tensors each")
        dtype = same_dtype([*outs, *ins], "alltoall")
        sc, rc = tuple(t.numel() for t in ins), tuple(t.numel() for t in outs)

        def fn():
            recv = torch.empty(sum(rc), dtype=dtype, device=device)
            self.impl.all_to_all(recv, torch.cat([t.reshape(-1) for t in ins]), sc, rc)
            off = 0
            for o in outs:
                o.copy_(recv[off:off + o.numel()].view_as(o))
                off += o.numel()
        return self._run("all_to_all", device, stream, outs, fn)

    def all_to_all_single(self, device, stream, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        from pycoll.c10d.backend import _split_counts

        out, inp = check_cuda(output, "all_to_all output"), check_cuda(input, "all_to_all input")
        same_dtype([out, inp], "all_to_all_single")
        sc = _split_counts(inp, input_split_sizes, self.world, "input")
        rc = _split_counts(out, output_split_sizes, self.world, "output")

        def fn():
            o, back = flat_out(out)
            self.impl.all_to_all(o, flat_in(inp), sc, rc)
            back()
        return self._run("all_to_all", device, stream, [out], fn)

    def barrier(self, device, stream, opts=None):
        return self._run("barrier", device, stream, [], self.impl.barrier)

    # -- point to point (nccl path; the ipc path stages these) -------------------------------
    def send(self, device, stream, tensors, dst_rank: int, tag: int = 0):
        (t,) = check_all(tensors, "send", exactly=1)
        peer = self.pg._check_peer(dst_rank, "send")
        return self._run("send", device, stream, [t], lambda: self.impl.send(flat_in(t), peer))

    def recv(self, device, stream, tensors, src_rank: int, tag: int = 0):
        (t,) = check_all(tensors, "recv", exactly=1)
        peer = self.pg._check_peer(src_rank, "recv")

        def fn():
            o, back = flat_out(t)
            self.impl.recv(o, peer)
            back()
        return self._run("recv", device, stream, [t], fn, source=peer)
