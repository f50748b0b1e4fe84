"""When a wait may poll before it blocks in the kernel: decided at run time, per wait.

Polling for a peer beats blocking only while the poller takes no core that another task
needs. On an idle machine a peer's arrival is then seen at once, where a futex or ``poll``
wake-up costs far more than a small op. On a busy one (DataLoader workers, a second job,
more ranks than cores, the peer's own threads) the spinning rank holds the core that the
peer, or the work the peer waits for, needs to arrive: a spin fixed at init made large
all_reduces slower than gloo's beside one busy process (figures: docs/performance.md,
"Waits under load").

So every spinning wait (shared-memory barriers, TCP steps) asks one ``SpinPolicy`` per wait
site, which combines three signs, none of them a setting:

- **the machine now**: the kernel's count of runnable tasks (``/proc/loadavg``, field 4:
  instantaneous, this poller included) against the online cores. More runnable tasks than
  cores means someone waits for a core, and a poll would keep one from it: block. A wait
  polls the first ``GRACE`` seconds without asking (a peer in step arrives within it, and
  the fast path then makes no system call at all); after that the count is read every
  ``RECHECK`` seconds, and a crowded read ends the spin. A site told "crowded" blocks at once
  for the next ``MEMORY`` seconds. (Two crowded reads in a row, so that a passing kernel
  thread would not count, were tried and not kept: docs/performance.md.)
- **the peers lately** (``AdaptiveSpin``): a spin left unanswered (the peer is late, or
  computing) halves the next; a wait that never blocked restores the whole budget; every
  ``PROBE``-th wait tries the whole budget again;
- **the thread**: the group's worker, which runs asynchronous ops while its caller computes
  (DDP's buckets during backward), polls at most ``BACKGROUND_SPIN``.

Past the grace, a poll yields the core at every turn (``sched_yield``), so that a task woken
onto this core runs at once instead of after the spin.
"""

from __future__ import annotations

import math
import os
import threading

_local = threading.local()

# A wait polls this long before it first asks whether the machine is crowded: ranks in step
# answer within it, and asking and yielding at every wait made idle small ops measurably
# slower (docs/performance.md, "Waits under load").
GRACE = 20e-6
# While a wait polls past the grace, how often it reads the runnable count again.
RECHECK = 50e-6
# How long a site that found the machine crowded blocks at once, without polling first.
MEMORY = 1e-3
# A thread that runs ops while their caller computes polls no longer than this: enough for
# a peer that is already on its way (ranks in step, the end of a backward), too short to take
# much of the core that the caller's computation needs when the peer is far behind.
BACKGROUND_SPIN = 100e-6


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_in_background() -> None:
    """Mark this thread as one that runs ops while their caller computes (the group's
    worker): its waits poll at most ``BACKGROUND_SPIN`` before they block."""
    _local.background = True


def spin_cap() -> float:
    """The longest this thread's wait may poll before it blocks."""
    return BACKGROUND_SPIN if getattr(_local, "background", False) else math.inf


class AdaptiveSpin:
    """How long a site's next wait polls before it blocks, learned from the last ones.

    A wait that never had to block (the peer answered within the spin, or was already
    there) says the peers are in step: the next gets the whole budget. A spin that ends
    unanswered cost its time for nothing (the peer is late, or computing), so the next gets
    half, down to none. Every ``PROBE``-th wait tries the whole budget again, so a site that
    stopped spinning finds out when it would pay again.
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


class RunnableTasks:
    """The machine's runnable tasks against its online cores, read from ``/proc/loadavg``.

    The count is machine-wide, so it is held against every online core, not this process's
    affinity (a job pinned to a few cores of a busy machine is then told "busy" too early,
    never too late). Where /proc is missing, nothing is known: ``crowded`` says no and the
    peers' answers alone steer the spin."""

    __slots__ = ("fd", "cores", "verdict", "read_at")

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.verdict = False          # the last read: crowded or not
        self.read_at = -math.inf      # when (the caller's clock) it was read
        try:
            self.fd: int | None = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.fd = None

    def running(self) -> int:
        """Runnable tasks now, this one included (0 where unknown)."""
        if self.fd is None:
            return 0
        try:
            text = os.pread(self.fd, 128, 0)
            return int(text.split(b" ", 4)[3].split(b"/", 1)[0])
        except (OSError, ValueError, IndexError):
            return 0

    def crowded(self, now: float) -> bool:
        """Whether more tasks are runnable than there are cores (this one counted)."""
        self.verdict = self.running() > self.cores
        self.read_at = now
        return self.verdict

    def lately_crowded(self, now: float) -> bool:
        return self.verdict and now - self.read_at < MEMORY

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SpinPolicy:
    """The spin decisions of one wait site (a shared-memory arena's barriers, a TCP
    transport's steps), one wait at a time: ``full`` seconds at most (0: never poll);
    ``tasks`` is its owner's ``RunnableTasks`` (the owner closes it). ``now`` is any one
    clock, the same for a whole wait:

        if policy.begin(now, limit):   # when a wait first finds its peer not there
            while peer not there and policy.poll(now): pass     # False: block now
        policy.answered() if the wait never blocked, else policy.unanswered()
    """

    __slots__ = ("full", "learned", "tasks", "budget", "end", "check_at", "spun_out", "past_grace")

    def __init__(self, full: float, tasks: RunnableTasks) -> None:
        self.full = max(0.0, full)
        self.learned = AdaptiveSpin(self.full)
        self.tasks = tasks
        self.budget = self.end = self.check_at = 0.0
        self.spun_out = self.past_grace = False

    def begin(self, now: float, limit: float = math.inf) -> bool:
        """Whether this wait may poll (for at most ``limit`` seconds); False: block at once."""
        self.spun_out = self.past_grace = False
        if not self.full or self.tasks.lately_crowded(now):
            self.budget = 0.0
            return False
        self.budget = budget = min(self.learned.budget(), spin_cap())
        if not budget:
            return False
        self.end = now + min(budget, limit)
        self.check_at = now + GRACE
        return True

    def poll(self, now: float) -> bool:
        """Whether to poll once more (past the grace, having yielded the core); False: the
        spin is over, block."""
        if now >= self.end:
            self.spun_out = True
            return False
        if now >= self.check_at:
            if self.tasks.crowded(now):
                return False   # a task waits for a core: give this one up (learn nothing)
            self.check_at = now + RECHECK
            self.past_grace = True
        if self.past_grace:
            os.sched_yield()
        return True

    def answered(self) -> None:
        """The wait never blocked (it polled, or found its peers there): they are in step."""
        self.learned.answered()

    def unanswered(self) -> None:
        """The wait blocked: if it was because the whole spin ran out, spin less next time
        (a capped spin, the worker's, teaches nothing about the peers)."""
        if self.spun_out and spin_cap() >= self.full:
            self.learned.unanswered(self.budget)
