"""Point-to-point part of the c10d backend: send, recv, recv from any source, and gloo's
monitored barrier, on top of the communicator's point-to-point engine (pycoll/p2p.py).

``PointToPoint`` is a base class of ``torch_backend.ProcessGroupPycoll`` (listed before
``dist.ProcessGroup`` so that these methods, not c10d's, are the ones found); it uses the
group's ``_comm``, ``_rank``, ``_size``, ``_timeout`` and ``_mb_count``. These calls do
not go through the collective queue: each posts a request on the engine and returns a
Work that the request's callback completes.
"""

from __future__ import annotations

import time

import torch

from pycoll.c10d.plans import check_tensors, flat_in, flat_out
from pycoll.core import collectives as C
from pycoll.core.executor import byte_view
from pycoll.core.work import Work
from pycoll.errors import CommTimeoutError
from pycoll.transport.p2p import ANY

MONITORED_BARRIER_TAG = -(1 << 40)


class PointToPoint:
    """The point-to-point methods of ProcessGroupPycoll."""

    def send(self, tensors, dst_rank: int, tag: int = 0):
        (t,) = check_tensors(tensors, "send", exactly=1)
        peer = self._check_peer(dst_rank, "send")
        f = flat_in(t)
        return self._p2p("send", peer, tag, t, f, None)

    def recv(self, tensors, src_rank: int, tag: int = 0):
        (t,) = check_tensors(tensors, "recv", exactly=1)
        peer = self._check_peer(src_rank, "recv")
        f, back = flat_out(t, "recv")
        return self._p2p("recv", peer, tag, t, f, back)

    def recv_anysource(self, tensors, tag: int = 0):
        (t,) = check_tensors(tensors, "recv", exactly=1)
        f, back = flat_out(t, "recv")
        return self._p2p("recv", ANY, tag, t, f, back)

    def _p2p(self, op, peer, tag, t, f, back) -> Work:
        work = Work(op, tag, [t])

        def done(r):
            # The engine's thread, holding no lock: pycoll's write-back, then the Work, whose
            # future callbacks (user code) are handed on to where user code may run.
            error = r.error
            if error is None and back is not None:
                try:
                    with torch.no_grad():
                        back()
                except Exception as exc:  # noqa: BLE001 - the Work must end, with the reason
                    error = exc
            if isinstance(error, CommTimeoutError) and error.timeout_s is None:
                error.timeout_s = self._timeout.total_seconds()
            work._src = r.source
            work.complete(error)

        post = self._comm.p2p.isend if op == "send" else self._comm.p2p.irecv
        post(peer, tag, byte_view(f), C.dtype_name(f.dtype), f.numel(), self._deadline(), done)
        return work

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """Gloo's monitored barrier: rank 0 names every rank that did not arrive in time.

        It runs on the point-to-point channel, so a failed monitored barrier does not
        break the group. torch's ``dist.monitored_barrier`` only accepts gloo; call this
        as ``pycoll.monitored_barrier(group, timeout, wait_all_ranks)``.
        """
        from pycoll.c10d.monitored import monitored_barrier

        self._mb_count += 1
        tag = MONITORED_BARRIER_TAG - self._mb_count
        return monitored_barrier(self, tag, self._timeout if timeout is None else timeout, wait_all_ranks)

    # -- helpers -------------------------------------------------------------------------
    def _deadline(self) -> float:
        return time.monotonic() + self._timeout.total_seconds()

    def _check_peer(self, peer: int, op: str) -> int:
        if not isinstance(peer, int) or not 0 <= peer < self._size:
            raise ValueError(f"{op}: peer rank {peer} is out of range for a group of size {self._size}")
        if peer == self._rank:
            raise ValueError(f"{op}: rank {peer} cannot {op} to itself")
        return peer
