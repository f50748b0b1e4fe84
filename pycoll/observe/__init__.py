"""Observers of the engine: tracing, clocks, straggler statistics, hang dumps, fault injection.

``for_group(rank)`` is what a new group is watched by, from the environment: the hang dump
always (SIGUSR1, and the line logged at a failure), a ``Tracer`` with ``PYCOLL_TRACE`` or
``PYCOLL_DEBUG``, an ``Injector`` with this rank's ``PYCOLL_FAULT`` specs. Straggler
statistics need no observer: they read the communicator's arrivals.
"""

from __future__ import annotations

from pycoll.core.observer import Observer
from pycoll.observe import faults, trace
from pycoll.observe.hangdump import HangDump


def for_group(rank: int) -> list[Observer]:
    members: list[Observer] = [HangDump()]
    if trace.wanted():
        members.append(trace.Tracer())
    injector = faults.injector(rank)
    if injector is not None:
        members.append(injector)
    return members
