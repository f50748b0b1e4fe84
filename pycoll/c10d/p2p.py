"""Point-to-point on CPU tensors: a send or receive plan posted on the group's engine.

These calls do not go through the collective queue: each posts a request on the
communicator's point-to-point engine (``transport/tcp/p2p.py``) and returns a Work that the
request's completion finishes. Also gloo's monitored barrier, which runs on the same engine.
"""

from __future__ import annotations

import time

import torch

from pycoll.c10d.monitored import monitored_barrier as _monitored
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
    work = Work(plan.op, plan.tag, [t])

    def done(r):
        # The engine's thread, holding no lock: pycoll's write-back, then the Work, whose
        # future callbacks (user code) are handed on to where user code may run.
        error = r.error
        if error is None:
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
    fn(peer, plan.tag, byte_view(f), collectives.dtype_name(f.dtype), f.numel(), time.monotonic() + timeout_s, done)
    return work


def monitored_barrier(pg, call: int, timeout, wait_all_ranks: bool):
    """Gloo's monitored barrier, the ``call``-th of this group (each on tags of its own)."""
    return _monitored(pg, tags.MONITORED_BARRIER - call, timeout, wait_all_ranks)
