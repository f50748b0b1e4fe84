"""A per-iteration record of when each bucket became ready, was launched and finished.

The reducer fills one ``Timeline`` per synchronised backward (``time.perf_counter``
seconds). It is how the overlap claim is checked: with several buckets, the early buckets'
all-reduce should end before ``backward_end``. An ``end`` is the first moment the reducer
found the collective complete: it polls ``is_completed()`` at every gradient hook, once more
just before stamping ``backward_end``, and at each wait. So ``end`` may be later than the
truth, never earlier, and ``end < backward_end`` means "done before backward ended".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BucketTimes:
    index: int
    nbytes: int
    ready: float = float("nan")    # last gradient of the bucket accumulated
    start: float = float("nan")    # all-reduce (or comm hook) launched
    end: float = float("nan")      # all-reduce finished

    def mark_end(self, now: float) -> None:
        # The first report wins: a poll that found it done comes before the final wait.
        if self.end != self.end:  # NaN check without math import on the hot path
            self.end = now


@dataclass
class Timeline:
    backward_start: float = float("nan")  # first gradient ready in this iteration
    backward_end: float = float("nan")    # autograd engine callback: backward done
    finalized: float = float("nan")       # all buckets waited for, gradients written back
    buckets: list[BucketTimes] = field(default_factory=list)

    def overlapped(self) -> list[int]:
        """Indices of buckets whose all-reduce ended before backward ended."""
        return [b.index for b in self.buckets if b.end < self.backward_end]

    def as_dict(self) -> dict:
        return {
            "backward_start": self.backward_start,
            "backward_end": self.backward_end,
            "finalized": self.finalized,
            "buckets": [vars(b).copy() for b in self.buckets],
        }
