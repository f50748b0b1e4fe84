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
(When a wait may poll before it blocks is ``transport.spin``'s.)
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

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

