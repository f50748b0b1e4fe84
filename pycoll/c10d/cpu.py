"""The CPU channel: a plan's primitive as a task of this rank's communicator.

The primitives are ``core.collectives``' functions of the same names (``sparse_all_reduce``:
``c10d.sparse``), called with the communicator, the plan's arguments and the op's sequence
number and deadline.
"""

from __future__ import annotations

from pycoll.c10d import sparse
from pycoll.c10d.checks import no_write_back
from pycoll.c10d.plans import Plan
from pycoll.core import collectives as C

PRIMITIVES = {"all_reduce": C.all_reduce, "broadcast": C.broadcast, "reduce": C.reduce,
              "all_gather": C.all_gather, "gather": C.gather, "scatter": C.scatter,
              "reduce_scatter": C.reduce_scatter, "all_to_all": C.all_to_all, "barrier": C.barrier,
              "sparse_all_reduce": sparse.all_reduce}


def task(comm, plan: Plan):
    """``task(seq, deadline)`` running ``plan`` on ``comm``."""
    args, finish = plan.args, plan.finish
    if plan.op == "all_reduce" and not callable(args):
        # The latency path: the small shared-memory round is chosen here, once.
        run = C.all_reduce_task(comm, *args)
        if finish is no_write_back:
            return run
    else:
        fn = PRIMITIVES[plan.op]

        def run(seq: int, deadline: float) -> None:
            fn(comm, *(args() if callable(args) else args), seq, deadline)
    if finish is no_write_back:
        return run

    def run_then_finish(seq: int, deadline: float) -> None:
        run(seq, deadline)
        finish()
    return run_then_finish
