"""Partial all-reduce (eager-SGD, Li et al. PPoPP 2020): solo and majority, bounded staleness.

::

    par = pycoll.partial.PartialAllReduce(grad, mode="majority", max_staleness=4)
    for step in range(n):
        work = par.submit(grad)          # deposit this step's tensor; returns at once
        total = work.wait()              # round `step`'s SUM; work.count deposits are in it
        ...                              # e.g. apply total / work.count
        # or, when nothing runs between the two: res = par.all_reduce(grad)
    leftover = par.flush()               # collective: the rounds no submit was paired with
    par.close()

A *round* is one all-reduce, over a private group, of ``[data..., metadata per rank]``.
Round k starts when its *initiator* arrives (solo: the first rank to deposit its k-th
tensor; majority: ``majority_initiator(seed, k)``), which sends an activation (p2p, round
number in the payload, one fixed tag: a posted receive cannot be cancelled, so each rank
keeps exactly one any-source receive posted) unless the round's all-reduce completes within
``activation_delay`` (every rank was on its way: no message needed). Every rank then
contributes its pending deposits of index <= k; later ones go to a later round: never
lost, never counted twice. A background thread serves rounds while the user's thread
computes; a user thread that waits runs them itself. Bookkeeping and the staleness bound:
``rounds.py``; semantics in full: docs/partial.md. Public torch.distributed API
only: any transport.
"""

from pycoll.partial.allreduce import DTYPES, PartialAllReduce
from pycoll.partial.rounds import MODES, RoundInfo, majority_initiator
from pycoll.partial.work import PartialWork, RoundResult

__all__ = ["PartialAllReduce", "PartialWork", "RoundResult", "RoundInfo", "majority_initiator", "MODES", "DTYPES"]
