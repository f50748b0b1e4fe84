"""The nccl path: one NCCL communicator per process group, through ``cupy.cuda.nccl``.

Set-up (at the group's first CUDA call, collectively): rank 0 draws the unique id with
``nccl.get_unique_id()`` and publishes it through the group's c10d Store; every rank builds
``NcclCommunicator(world, uid, rank)`` with its tensors' device current.

Every primitive is enqueued on the caller's current stream (``stream.cuda_stream`` is the
``cudaStream_t`` handed to NCCL) on the tensors' own memory (``data_ptr()``); nothing blocks
the host except ``barrier``, which waits for its 1-element all-reduce as torch's NCCL barrier
does. Data movement moves bytes (uint8), so any dtype travels; reductions use the table in
``dtypes.py``. all_to_all, gather, scatter and uneven reduce_scatter are grouped send/recv (or
grouped reduces) between ``nccl.groupStart()`` and ``nccl.groupEnd()``; a rank's own block is a
device copy.

No watchdog: a peer that dies mid-collective leaves this rank's kernel waiting, as NCCL does
without torch's watchdog. ``Work.wait(timeout=...)`` polls and raises instead of hanging, and
the group's ``abort()`` aborts the communicator.
"""

from __future__ import annotations

import json

import torch

from pycoll.algorithms.schedule import displacements
from pycoll.cuda import dtypes


class NcclPath:
    name = "nccl"

    def __init__(self, store, rank: int, world: int, device: torch.device) -> None:
        import cupy
        from cupy.cuda import nccl

        dtypes.check_cupy_constants(nccl)
        self.nccl, self.rank, self.world, self.device = nccl, rank, world, device
        self.version = nccl.get_version()
        key = "pycoll/cuda/nccl/uid"
        if rank == 0:
            uid = nccl.get_unique_id()
            store.set(key, json.dumps(list(uid)))
        else:
            uid = tuple(json.loads(store.get(key).decode()))
        with torch.cuda.device(device), cupy.cuda.Device(device.index):
            self.comm = nccl.NcclCommunicator(world, tuple(uid), rank)
        self._one = torch.zeros(1, dtype=torch.int32, device=device)

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def check_reduction(self, dtype: torch.dtype, red) -> None:
        dtypes.nccl_reduction(dtype, red.name, self.version)  # raises NcclUnsupported (a ValueError)

    def _reduce_args(self, t: torch.Tensor, red):
        """(tensor to hand NCCL, count, datatype, op, divide afterwards)."""
        nr = dtypes.nccl_reduction(t.dtype, red.name, self.version)
        view = torch.view_as_real(t).view(-1) if nr.as_real else t
        if t.dtype is torch.bool:
            view = t.view(torch.uint8)
        return view, view.numel(), nr.datatype, nr.op, nr.divide

    def _bytes(self, t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.numel() * t.element_size()

    # -- primitives --------------------------------------------------------------------------
    def all_reduce(self, t, red) -> None:
        red.prepare(t)
        v, n, dt, op, divide = self._reduce_args(t, red)
        if n:
            self.comm.allReduce(v.data_ptr(), v.data_ptr(), n, dt, op, self._stream())
        if divide:
            red.finish(t)

    def broadcast(self, t, root: int) -> None:
        ptr, nbytes = self._bytes(t)
        if nbytes:
            self.comm.broadcast(ptr, ptr, nbytes, dtypes.UINT8, root, self._stream())

    def reduce(self, t, root: int, red) -> None:
        src = t
        if red.factor is not None:
            src = t.clone()
            red.prepare(src)
        s, n, dt, op, divide = self._reduce_args(src, red)
        d, _, _, _, _ = self._reduce_args(t, red)
        if n:
            self.comm.reduce(s.data_ptr(), d.data_ptr(), n, dt, op, root, self._stream())
        if divide and self.rank == root:
            red.finish(t)

    def all_gather(self, out, inp) -> None:
        ptr, nbytes = self._bytes(inp)
        if nbytes:
            self.comm.allGather(ptr, out.data_ptr(), nbytes, dtypes.UINT8, self._stream())

    def reduce_scatter(self, out, inp, counts, red) -> None:
        if red.factor is not None:
            inp = inp.clone()
            red.prepare(inp)
        s = self._stream()
        o, n, dt, op, divide = self._reduce_args(out, red)
        if len(set(counts)) == 1:
            if n:
                i = self._reduce_args(inp, red)[0]
                self.comm.reduceScatter(i.data_ptr(), o.data_ptr(), n, dt, op, s)
        else:  # uneven blocks: one reduce per block, rooted at its owner, in one group
            disp = displacements(counts)
            self.nccl.groupStart()
            try:
                for q, c in enumerate(counts):
                    if c:
                        i, m = self._reduce_args(inp[disp[q]:disp[q] + c], red)[:2]
                        dst = o if q == self.rank else i   # recvbuff is ignored off the root
                        self.comm.reduce(i.data_ptr(), dst.data_ptr(), m, dt, op, q, s)
            finally:
                self.nccl.groupEnd()
        if divide:
            red.finish(out)

    def all_to_all(self, out, inp, send_counts, recv_counts) -> None:
        sd, rd = displacements(send_counts), displacements(recv_counts)
        me, s, isz = self.rank, self._stream(), inp.element_size()
        out[rd[me]:rd[me] + recv_counts[me]].copy_(inp[sd[me]:sd[me] + send_counts[me]])
        self.nccl.groupStart()
        try:
            for q in range(self.world):
                if q == me:
                    continue
                if send_counts[q]:
                    self.comm.send(inp[sd[q]:].data_ptr(), send_counts[q] * isz, dtypes.UINT8, q, s)
                if recv_counts[q]:
                    self.comm.recv(out[rd[q]:].data_ptr(), recv_counts[q] * isz, dtypes.UINT8, q, s)
        finally:
            self.nccl.groupEnd()

    def gather(self, out, inp, root: int) -> None:
        n, s = inp.numel(), self._stream()
        nbytes = n * inp.element_size()
        if self.rank == root:
            out[root * n:(root + 1) * n].copy_(inp)
        if not nbytes:
            return
        self.nccl.groupStart()
        try:
            if self.rank == root:
                for q in range(self.world):
                    if q != root:
                        self.comm.recv(out[q * n:].data_ptr(), nbytes, dtypes.UINT8, q, s)
            else:
                self.comm.send(inp.data_ptr(), nbytes, dtypes.UINT8, root, s)
        finally:
            self.nccl.groupEnd()

    def scatter(self, out, inp, root: int) -> None:
        n, s = out.numel(), self._stream()
        nbytes = n * out.element_size()
        if self.rank == root:
            out.copy_(inp[root * n:(root + 1) * n])
        if not nbytes:
            return
        self.nccl.groupStart()
        try:
            if self.rank == root:
                for q in range(self.world):
                    if q != root:
                        self.comm.send(inp[q * n:].data_ptr(), nbytes, dtypes.UINT8, q, s)
            else:
                self.comm.recv(out.data_ptr(), nbytes, dtypes.UINT8, root, s)
        finally:
            self.nccl.groupEnd()

    def barrier(self) -> None:
        self.comm.allReduce(self._one.data_ptr(), self._one.data_ptr(), 1, dtypes.INT32, dtypes.SUM, self._stream())
        torch.cuda.current_stream().synchronize()

    def send(self, t, peer: int) -> None:
        ptr, nbytes = self._bytes(t)
        if nbytes:
            self.comm.send(ptr, nbytes, dtypes.UINT8, peer, self._stream())

    def recv(self, t, peer: int) -> None:
        ptr, nbytes = self._bytes(t)
        if nbytes:
            self.comm.recv(ptr, nbytes, dtypes.UINT8, peer, self._stream())

    # -- lifecycle ---------------------------------------------------------------------------
    def abort_peers(self, why: str) -> None:
        self.close(abort=True)

    def close(self, abort: bool = False) -> None:
        comm, self.comm = getattr(self, "comm", None), None
        if comm is None:
            return
        if abort:
            comm.abort()
        else:
            comm.destroy()
