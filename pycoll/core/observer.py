"""What the engine tells those who watch it: one interface, called at fixed points.

The communicator, its executors and its shared-memory arena call these hooks; each observer
(``pycoll.observe``: tracing, fault injection, the hang dump) implements the ones it needs.
Nothing else connects them: an observer sees the engine through the hooks' arguments and the
communicator's public state (``Communicator.snapshot()``, ``arrivals``, ``p2p``), and plants
nothing on it.

==============================================  ===============================================
hook                                             called
==============================================  ===============================================
``started(comm)``                                once the group is up, before its first op
``transport(t) -> t``                            for each TCP transport the group builds; the
                                                 result is used instead (fault injection wraps)
``before_op(op, seq)``                           when an op starts running
``after_op(op, seq, t0, t1, mode)``              when an op ends without error
``failed(comm, exc)``                            when an op fails (the group is about to break)
``step(sig, algo, i, step, itemsize, t0, t1)``   after each step of a TCP schedule
``barrier_begins(arena)``                        before each shared-memory barrier
``barrier(words, b, rnd, nbytes, tp, t0, t1)``   after each shared-memory barrier
``closing(comm, abort)``                         when the group is destroyed
==============================================  ===============================================

The hot path pays for a hook only when some observer has it: ``Observers`` exposes each hook
as None when no observer overrides it, and the engine tests for None before calling.
"""

from __future__ import annotations

from typing import Callable, Sequence

HOOKS = ("started", "transport", "before_op", "after_op", "failed", "step", "barrier_begins", "barrier",
         "closing")


class Observer:
    """Base class: every hook does nothing; an observer overrides the ones it needs."""

    def started(self, comm) -> None:
        pass

    def transport(self, t):
        return t

    def before_op(self, op: str, seq: int) -> None:
        pass

    def after_op(self, op: str, seq: int, t0: float, t1: float, mode: str) -> None:
        pass

    def failed(self, comm, exc: BaseException) -> None:
        pass

    def step(self, sig, algo: str, i: int, step, itemsize: int, t0: float, t1: float) -> None:
        pass

    def barrier_begins(self, arena) -> None:
        pass

    def barrier(self, words, b: int, rnd: int, nbytes: int, tp: float, t0: float, t1: float) -> None:
        pass

    def closing(self, comm, abort: bool) -> None:
        pass


class Observers:
    """A group's observers as one: each hook is None (nobody has it), or a callable."""

    def __init__(self, members: Sequence[Observer] = ()) -> None:
        self.members = list(members)
        for hook in HOOKS:
            fns = [getattr(m, hook) for m in self.members
                   if getattr(type(m), hook) is not getattr(Observer, hook)]
            setattr(self, hook, _join(hook, fns))


def _join(hook: str, fns: list[Callable]) -> Callable | None:
    if not fns:
        return None
    if len(fns) == 1:
        return fns[0]
    if hook == "transport":
        def wrap(t):
            for fn in fns:
                t = fn(t)
            return t
        return wrap

    def fan_out(*args):
        for fn in fns:
            fn(*args)
    return fan_out
