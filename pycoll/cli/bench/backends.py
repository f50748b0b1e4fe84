"""Backend adapters: the verbs the collective table calls, for torch.distributed and mpi4py.

Each adapter maps one verb to one library call and adds nothing else, so the timed region holds
the backend's own cost only. Roots and peers are global ranks; the benchmark's groups span the
whole world, so group ranks and global ranks coincide.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pycoll.torch_compat import all_gather_single as _all_gather
from pycoll.torch_compat import reduce_scatter_single as _reduce_scatter

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
              "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchApi:
    """Verbs over one torch.distributed process group (gloo, pycoll, ...)."""

    def __init__(self, group, op: str):
        self.group = group
        self.op = _TORCH_OPS[op]
        self.world = dist.get_world_size(group)  # looked up once, not inside the timed call

    def all_reduce(self, buf):
        dist.all_reduce(buf, op=self.op, group=self.group)

    def broadcast(self, buf, root):
        dist.broadcast(buf, src=root, group=self.group)

    def reduce(self, buf, root, is_root):
        dist.reduce(buf, dst=root, op=self.op, group=self.group)

    def all_gather(self, out, inp):
        _all_gather(out, inp, group=self.group)

    def reduce_scatter(self, out, inp):
        _reduce_scatter(out, inp, op=self.op, group=self.group)

    def all_to_all(self, out, inp):
        dist.all_to_all_single(out, inp, group=self.group)

    def gather(self, out, inp, root, is_root):
        # views of one flat tensor: the root's result is contiguous like the other backends'
        chunks = list(out.chunk(self.world)) if is_root else None
        dist.gather(inp, gather_list=chunks, dst=root, group=self.group)

    def scatter(self, out, inp, root, is_root):
        chunks = list(inp.chunk(self.world)) if is_root else None
        dist.scatter(out, scatter_list=chunks, src=root, group=self.group)

    def barrier(self):
        dist.barrier(group=self.group)

    def send(self, buf, peer):
        dist.send(buf, dst=peer, group=self.group)

    def recv(self, buf, peer):
        dist.recv(buf, src=peer, group=self.group)


# MPI has no standard half / bfloat16 type; those dtypes get no MPI column.
MPI_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8}


class MpiApi:
    """Verbs over an mpi4py communicator, buffer methods on numpy views of the same tensors."""

    def __init__(self, comm, op: str):
        from mpi4py import MPI  # only ever imported inside the mpirun ranks
        self.MPI = MPI
        self.comm = comm
        self.op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]

    @staticmethod
    def _np(t: torch.Tensor):
        return t.numpy()  # shares memory: no copy in or out of the timed call

    def all_reduce(self, buf):
        self.comm.Allreduce(self.MPI.IN_PLACE, self._np(buf), op=self.op)  # in place, as torch

    def broadcast(self, buf, root):
        self.comm.Bcast(self._np(buf), root=root)

    def reduce(self, buf, root, is_root):
        if is_root:
            self.comm.Reduce(self.MPI.IN_PLACE, self._np(buf), op=self.op, root=root)
        else:
            self.comm.Reduce(self._np(buf), None, op=self.op, root=root)

    def all_gather(self, out, inp):
        self.comm.Allgather(self._np(inp), self._np(out))

    def reduce_scatter(self, out, inp):
        self.comm.Reduce_scatter_block(self._np(inp), self._np(out), op=self.op)

    def all_to_all(self, out, inp):
        self.comm.Alltoall(self._np(inp), self._np(out))

    def gather(self, out, inp, root, is_root):
        self.comm.Gather(self._np(inp), self._np(out) if is_root else None, root=root)

    def scatter(self, out, inp, root, is_root):
        self.comm.Scatter(self._np(inp) if is_root else None, self._np(out), root=root)

    def barrier(self):
        self.comm.Barrier()

    def send(self, buf, peer):
        self.comm.Send(self._np(buf), dest=peer)

    def recv(self, buf, peer):
        self.comm.Recv(self._np(buf), source=peer)
