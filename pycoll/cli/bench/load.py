"""Busy processes beside the ranks: the load a benchmark or test runs under.

A user's machine is never idle (DataLoader workers, a second job, the rank's own threads), so
every speed claim is measured under load as well as idle. ``Busy(n)`` starts ``n`` processes
that each spin a plain Python loop (no torch: they start in tens of milliseconds), waits until
each is running, and kills them when the ``with`` block ends, whatever ends it:

    with Busy(2) as load:
        ...                          # the ranks run beside two busy processes
    print(load.describe())           # "2 busy processes (load average 2.31 at the end)"

``python -m pycoll bench --load N`` and ``tools/bench_ddp.py --load N`` use it; so do the tests
that hold pycoll to gloo's speed under load.
"""

from __future__ import annotations

import os
import subprocess
import sys

_LOOP = "import sys; sys.stdout.write('go\\n'); sys.stdout.flush()\nwhile True: pass\n"


def loadavg() -> float | None:
    """The one-minute load average, or None where /proc is not there."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Busy:
    """``n`` busy processes for the length of a ``with`` block (n = 0: nothing)."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"the number of busy processes must be >= 0, got {n}")
        self.n = n
        self.procs: list[subprocess.Popen] = []
        self.loadavg_end: float | None = None

    def __enter__(self) -> "Busy":
        try:
            for _ in range(self.n):
                p = subprocess.Popen([sys.executable, "-S", "-c", _LOOP], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "")})
                self.procs.append(p)
            for p in self.procs:   # each has printed its line: it is in its loop
                if p.stdout.readline() != b"go\n":
                    raise RuntimeError(f"busy process {p.pid} did not start (exit code {p.poll()})")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.loadavg_end = loadavg()
        self.stop()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs = []

    def describe(self) -> str:
        what = "no busy process" if self.n == 0 else f"{self.n} busy process{'es' * (self.n > 1)}"
        la = self.loadavg_end if self.loadavg_end is not None else loadavg()
        return what + (f" (load average {la:.2f} at the end)" if la is not None else "")

