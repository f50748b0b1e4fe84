"""The CPU channel: a plan's primitive as a task of this rank's communicator.

The primitives are ``core.collectives``' functions of the same names (``sparse_all_reduce``:
``c10d.sparse``), called with the communicator, the plan's arguments and the op's sequence
number and deadline.
"""

from __future__ import annotations

from pycoll.c10d import sparse
from pycoll.c10d.checks import no_write_back
from pycoll.c10d.plans import Plan
from pycoll.core import collectives

PRIMITIVES = {"all_reduce": collectives.all_reduce, "broadcast": collectives.broadcast, "reduce": collectives.reduce,
              "all_gather": collectives.all_gather, "gather": collectives.gather, "scatter": collectives.scatter,
              "reduce_scatter": collectives.reduce_scatter, "all_to_all": collectives.all_to_all, "barrier": collectives.barrier,
              "sparse_all_reduce": sparse.all_reduce}


def task(comm, plan: Plan):
    """``task(seq, deadline)`` running ``plan`` on ``comm``."""
    args, finish = plan.args, plan.finish
    if plan.op == "all_reduce" and not callable(args):
        # The latency path: the small shared-memory round is chosen here, once.
        run = collectives.all_reduce_task(comm, *args)
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
