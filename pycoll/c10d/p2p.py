"""Point-to-point on CPU tensors: a send or receive plan posted on the group's engine.

These calls do not go through the collective queue: each posts a request on the
communicator's point-to-point engine (``transport/tcp/p2p.py``) and returns a Work that the
request's completion finishes. Also gloo's monitored barrier, which runs on the same engine.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from pycoll.c10d.monitored import monitored_barrier as _monitored
from pycoll.c10d.checks import no_write_back
from pycoll.c10d.plans import Plan
from pycoll.core import collectives
from pycoll.core import tags
from pycoll.core.executor import byte_view
from pycoll.core.work import Work
from pycoll.errors import CommTimeoutError


def check_user_tag(tag: int, op: str) -> None:
    where = tags.reserved(tag)
    if where is not None:
        raise ValueError(f"{op}: tag {tag} is reserved by pycoll (its {where} exchanges); use another tag")


def post(comm, plan: Plan, timeout_s: float) -> Work:
    """Post ``plan`` (a send or a receive) on ``comm``'s engine; the Work ends with it."""
    check_user_tag(plan.tag, plan.op)
    f, peer = plan.args
    back, t = plan.finish, plan.outputs[0]
    work = P2PWork(plan.op, plan.tag, [t])

    def done(r):
        # The engine's thread, holding no lock: pycoll's write-back, then the Work, whose
        # future callbacks (user code) are handed on to where user code may run.
        error = r.error
        if error is None and back is not no_write_back:
            try:
                with torch.no_grad():
                    back()
            except Exception as exc:  # noqa: BLE001 - the Work must end, with the reason
                error = exc
        if isinstance(error, CommTimeoutError) and error.timeout_s is None:
            error.timeout_s = timeout_s
        work._src = r.source
        work.complete(error)

    engine = comm.p2p
    fn = engine.isend if plan.op == "send" else engine.irecv
    req = fn(peer, plan.tag, byte_view(f), collectives.dtype_name(f.dtype), f.numel(), time.monotonic() + timeout_s,
             done)
    local = engine.local
    if local is not None and not req.done.is_set() and local.drives(req):
        work._req, work._local = req, local
    return work


class P2PWork(Work):
    """A send's or receive's Work. One with a rank of this host progresses where it is
    waited for (``pycoll.transport.tcp.p2p_local``): ``wait`` polls the rings in the caller's
    thread, ``is_completed`` looks once, and a future makes the engine's thread watch."""

    _req = None
    _local = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self._done and self._local is not None:
            limit = timeout.total_seconds() if timeout else None
            end = None if limit is None else time.monotonic() + limit
            self._local.drive(self._req, end)
            if end is not None:   # what is left of the timeout (0 would mean none)
                timeout = timedelta(seconds=max(1e-6, end - time.monotonic()))
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not self._done and self._local is not None:
            self._local.poke(self._req)
        return self._done

    def get_future(self) -> torch.futures.Future:
        if not self._done and self._local is not None:
            self._local.observe(self._req)
        return super().get_future()


def monitored_barrier(pg, call: int, timeout, wait_all_ranks: bool):
    """Gloo's monitored barrier, the ``call``-th of this group (each on tags of its own)."""
    return _monitored(pg, tags.MONITORED_BARRIER - call, timeout, wait_all_ranks)
