"""A one-shot hook run by the thread that executes a collective once it has waited too long.

``pycoll.partial`` uses it to activate late ranks from inside the initiator's own all-reduce
(a timer thread would cost a thread wake-up, and a fight for the GIL, every round even when
nobody is late). The transports' wait loops (shared-memory futex waits, TCP polls) call
``due()`` before they block and cap their wait by what it returns; it costs one thread-local
lookup, and only once a wait is about to block.

    with waits.OnSlow(0.002, activate):   # activate() runs at most once, in this thread,
        dist.all_reduce(buf, group=pg)         # if the collective is still waiting after 2 ms

Only collectives that run in the calling thread see the hook (pycoll runs a blocking call
inline when nothing is queued before it; ops run by the group's worker thread do not).

It also holds the one rule for when a wait may spin before it blocks (``cores_to_spare``:
the shared-memory barriers and TCP steps both follow it) and for how long a thread may
(``spin_cap``: the group's worker, which runs asynchronous ops while the caller computes,
only briefly, so that its polling does not take the core the computation needs).
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Callable

import torch

_local = threading.local()


class OnSlow:
    """Set this thread's hook for the length of a ``with`` block (a class: a generator-based
    context manager costs three times as much, and the partial all-reduce enters one every
    round)."""

    __slots__ = ("delay", "fn")

    def __init__(self, delay: float, fn: Callable[[], None]) -> None:
        self.delay, self.fn = delay, fn

    def __enter__(self) -> None:
        _local.hook = (time.monotonic() + self.delay, self.fn)

    def __exit__(self, *exc) -> None:
        _local.hook = None


def due(now: float) -> float:
    """Seconds until this thread's hook is due (inf: none); runs it, once, when it is."""
    hook = getattr(_local, "hook", None)
    if hook is None:
        return math.inf
    if now < hook[0]:
        return hook[0] - now
    _local.hook = None
    hook[1]()
    return math.inf


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cores_to_spare(local_ranks: int) -> bool:
    """Whether every local rank, with torch's intra-op threads, has a core of its own: only
    then does polling for a peer beat blocking in the kernel (a wake-up costs tens to
    hundreds of microseconds on a VM); otherwise a spinning rank takes the core a peer, or
    the peer's intra-op thread, needs."""
    return local_ranks * torch.get_num_threads() <= cores()


class AdaptiveSpin:
    """How long a thread's next wait polls before it blocks, learned from the last ones.

    A wait that never had to block (the peer answered within the spin, or its frames were
    already there) says the peers are in step: the next gets the whole budget. A
    spin that ends unanswered cost its time for nothing (the peer is late, or asleep, or
    shares this rank's core and cannot run while this rank spins: then every op costs a
    whole spin), so the next gets half, down to none. Every ``PROBE``-th wait tries the
    whole budget again, so a group that stopped spinning finds out when it would pay again.
    """

    PROBE = 16
    SMALLEST = 25e-6     # below this a spin is not worth starting

    __slots__ = ("full", "now", "count")

    def __init__(self, full: float) -> None:
        self.full = self.now = full
        self.count = 0

    def budget(self) -> float:
        self.count += 1
        return self.full if self.count % self.PROBE == 0 else self.now

    def answered(self) -> None:
        self.now = self.full

    def unanswered(self, budget: float) -> None:
        half = budget / 2
        self.now = half if half >= self.SMALLEST else 0.0


# A thread that runs ops while their caller computes polls no longer than this: enough for
# a peer that is already on its way (ranks in step, the end of a backward), too short to take
# much of the core that the caller's computation needs when the peer is far behind.
BACKGROUND_SPIN = 100e-6


def run_in_background() -> None:
    """Mark this thread as one that runs ops while their caller computes (the group's
    worker): its waits poll at most ``BACKGROUND_SPIN`` before they block."""
    _local.background = True


def spin_cap() -> float:
    """The longest this thread's wait may poll before it blocks."""
    return BACKGROUND_SPIN if getattr(_local, "background", False) else math.inf
