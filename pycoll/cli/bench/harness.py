"""The shared, backend-neutral sweep loop every rank runs: timing, interleaving, checking.

For each (collective, size) the backends run alternately, A B A B ... in ``rounds`` chunks of
iterations, so slow phases of a noisy shared machine land on all of them alike. Each iteration is
prepared (input reset, sentinel fill) outside the timed region, timed alone with perf_counter, and
the first and last timed iteration of each backend is checked against locally computed expected
values, also outside the timed region. Times are per rank; the launcher combines ranks.

After every chunk the ranks agree (``agree``, over a channel that is not under test) on which
backends are still healthy: a backend that raised on one rank is dropped on all of them for the
rest of that collective, so one rank never waits alone in a collective the others abandoned.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from pycoll.cli.bench.collectives import COLLECTIVES, DTYPES, participates, reset


class Progress:
    """One status line on stderr (rewritten in place on a terminal, throttled lines otherwise)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = self.last = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self.last < 5.0 and self.done < self.total:
            return  # a log file should not get one line per size
        self.last = now
        pct = 100 * self.done // max(1, self.total)
        line = (f"[bench {self.label}] {self.done}/{self.total} ({pct}%) {what}  "
                f"{now - self.start:.0f}s")
        if self.tty:
            sys.stderr.write("\r" + line.ljust(78) + ("\n" if self.done >= self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def split_rounds(iters: int, rounds: int) -> list[int]:
    """Iterations per round, as even as possible: 10 in 4 rounds -> [3, 3, 2, 2]."""
    rounds = max(1, min(rounds, iters))
    return [iters // rounds + (1 if i < iters % rounds else 0) for i in range(rounds)]


def _looks_fatal(err: str) -> bool:
    # After a timeout or a dead connection a group is usually unusable: stop using it entirely
    # rather than paying the timeout again for every remaining collective.
    low = err.lower()
    return any(w in low for w in ("timed out", "timeout", "connection", "broken pipe", "reset"))


def sweep_plan(cfg: dict, world: int) -> list[tuple[str, int, int]]:
    """(collective, count, bytes) in run order; sizes that round to the same count run once."""
    elt = DTYPES[cfg["dtype"]].itemsize
    plan = []
    for name in cfg["collectives"]:
        coll, seen = COLLECTIVES[name], set()
        for size in ([0] if name == "barrier" else cfg["sizes"]):
            count, nbytes = coll.counts(size, world, elt)
            if count not in seen:
                seen.add(count)
                plan.append((name, count, nbytes))
    return plan


def run_sweep(cfg: dict, rank: int, world: int, apis: dict, agree: Callable[[list], list],
              progress: Progress | None = None) -> list[dict]:
    """Run the whole sweep on this rank; returns one record per (collective, size, backend)."""
    dtype = DTYPES[cfg["dtype"]]
    dead: dict[str, str] = {}  # backend -> fatal error: skipped for the rest of the run
    records = []
    current, dropped = None, {}
    for name, count, nbytes in sweep_plan(cfg, world):
        coll = COLLECTIVES[name]
        if name != current:
            current, dropped = name, dict(dead)  # a non-fatal failure only drops one collective
        bufs = coll.setup(count, rank, world, dtype, cfg["op"])
        rec = {b: {"collective": name, "size": nbytes, "count": count, "backend": b,
                   "times_us": [], "wrong": 0, "error": dropped.get(b)} for b in apis}
        live = [b for b in apis if b not in dropped]
        done = {b: 0 for b in apis}
        active = participates(coll, rank, world)

        def chunk(b: str, n: int, timed: bool) -> str | None:
            if timed and cfg.get("timing") == "loop":
                return loop_chunk(b, n)
            try:
                for _ in range(n):
                    i = done[b]
                    checked = timed and coll.check is not None and i in (0, cfg["iters"] - 1)
                    reset(coll, bufs, checked)
                    t0 = time.perf_counter_ns()
                    coll.run(apis[b], bufs, rank, world)
                    t1 = time.perf_counter_ns()
                    if not timed:
                        continue
                    done[b] += 1
                    rec[b]["times_us"].append((t1 - t0) / 1e3 * coll.time_scale
                                              if active else None)
                    if checked:
                        rec[b]["wrong"] += coll.check(bufs, rank, world)
            except Exception as e:  # noqa: BLE001 - any backend failure is reported, not fatal
                return f"{type(e).__name__}: {e}"
            return None

        def loop_chunk(b: str, n: int) -> str | None:
            """nccl-tests style: a reset, a barrier, then ``n`` back-to-back ops in one timer,
            each credited with the mean. Only the backend's first round starts with one
            untimed, checked op: later ops keep summing into their input."""
            try:
                api = apis[b]
                if coll.check is not None and done[b] == 0:
                    reset(coll, bufs, True)
                    coll.run(api, bufs, rank, world)
                    rec[b]["wrong"] += coll.check(bufs, rank, world)
                reset(coll, bufs, False)
                api.barrier()
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    coll.run(api, bufs, rank, world)
                per = (time.perf_counter_ns() - t0) / n / 1e3 * coll.time_scale
                done[b] += n
                rec[b]["times_us"].extend([per if active else None] * n)
            except Exception as e:  # noqa: BLE001 - any backend failure is reported, not fatal
                return f"{type(e).__name__}: {e}"
            return None

        phases = [(cfg["warmup"], False)] + [(k, True) for k in
                                             split_rounds(cfg["iters"], cfg["rounds"])]
        for n, timed in phases:
            for b in list(live):
                err = chunk(b, n, timed)
                # both flags agreed, so every rank drops (and kills) the same backends
                ok, survivable = agree([err is None, not (err and _looks_fatal(err))])
                if not ok:
                    msg = err or "failed on another rank"
                    rec[b]["error"] = msg
                    live.remove(b)
                    dropped[b] = f"skipped after an error at {nbytes} B: {msg}"
                    if not survivable:
                        dead[b] = dropped[b]
        records.extend(rec.values())
        bufs = None  # free before the next (possibly larger) size is allocated
        if progress is not None:
            progress.step(f"{name} {nbytes} B")
    return records
