"""What the partial all-reduce's rules allow, without any implementation cost: a model of
tools/eager_sgd.py's runs.

    python tools/eager_sgd_model.py                  # the experiment's defaults
    python tools/eager_sgd_model.py --grace 0 2 10   # how the grace period weighs

A discrete-event replay of the rules in docs/partial.md on the experiment's own straggler
sequences (the same seeded RNG: one rank per step sleeping ``U(delay_lo, delay_hi)`` ms, or
with ``--delay-prob p`` each rank independently with probability p) and the same majority
initiators (``majority_initiator(0, k, world)``). Each step a rank computes ``compute`` ms
(plus its sleep), deposits, and cannot start the next step before the round paired with its
deposit is done. A round starts when its initiator has deposited (solo: the first rank to),
after the previous round and after every rank the staleness bound requires; another rank
enters at its own deposit or when the initiator's grace period runs out, whichever is
first, and contributes its deposit only if it had made it by then. A round takes
``overhead`` ms. Full sync: every step ends at the latest rank's deposit plus ``overhead``.

It prints the time full sync takes over the time each mode takes, at several steps: the
speed-up in steps per second that these rules allow when a round costs nothing but
``overhead`` (the experiment's time to an accuracy also depends on how stale gradients slow
learning). The pure function ``simulate`` is tested in tests/clients/test_eager_sgd_model.py.

Majority at two ranks has a closed-form ceiling: one rank late by d every step, nothing else
costing time, full sync over majority tends to 3 - sqrt(3) = 1.268 (derived in
docs/partial.md; the model converges to it, a test checks).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `pycoll` importable
    sys.path.insert(0, str(REPO))

from pycoll.partial.rounds import majority_initiator  # noqa: E402


def stragglers(world: int, seed: int, steps: int, lo_ms: float, hi_ms: float,
               prob: float | None = None) -> list[list[float]]:
    """tools/eager_sgd.py's sequence: each step, the ms each rank sleeps before its forward.
    ``prob`` None: one rank per step, drawn uniformly; else each rank with probability
    ``prob``. The same RNG calls on every rank, so every rank replays the same sequence."""
    rng = random.Random(seed * 7919 + world)
    out = []
    for _ in range(steps):
        delays = [0.0] * world
        if prob is None:
            who = rng.randrange(world)
            delays[who] = rng.uniform(lo_ms, hi_ms)
        else:
            for r in range(world):
                if rng.random() < prob:
                    delays[r] = rng.uniform(lo_ms, hi_ms)
        out.append(delays)
    return out


def simulate(mode: str, seq: list[list[float]], world: int, compute: float = 1.5,
             grace: float = 10.0, overhead: float = 0.3, max_staleness: int = 8,
             seed: int = 0) -> list[float]:
    """End time (ms) of each step: when the last rank has its result of that step's round."""
    if mode == "full":
        t, ends = 0.0, []
        for delays in seq:
            t += compute + max(delays) + overhead
            ends.append(t)
        return ends
    start = [0.0] * world            # when each rank starts its next step
    last = [-1] * world              # highest deposit index each rank has contributed
    deps: list[list[float]] = []     # deposit times: deps[n][r]
    prev, ends = 0.0, []
    for n, delays in enumerate(seq):
        dep = [start[r] + compute + delays[r] for r in range(world)]
        deps.append(dep)
        init = majority_initiator(seed, n, world) if mode == "majority" else min(range(world), key=dep.__getitem__)
        floor = n - max_staleness
        required = [r for r in range(world) if last[r] < floor]
        t0 = max([dep[init], prev] + [deps[floor][r] for r in required])
        enter = [t0 if r == init else max(min(max(dep[r], prev), t0 + grace),
                                          deps[floor][r] if r in required else 0.0)
                 for r in range(world)]
        done = max(enter) + overhead
        for r in range(world):     # the newest deposit each rank had made when it entered
            j = n
            while j > last[r] and deps[j][r] > enter[r]:
                j -= 1
            last[r] = j
        prev = done
        start = [max(dep[r], done) for r in range(world)]
        ends.append(max(start))
    return ends


def speedups(world: int, mode: str, seeds: int, steps: int, at: list[int], **kw) -> list[float]:
    """Median over seeds of full sync's time over ``mode``'s time at each step in ``at``."""
    lo, hi, prob = kw.pop("delay_lo"), kw.pop("delay_hi"), kw.pop("delay_prob", None)
    per_seed = []
    for seed in range(seeds):
        seq = stragglers(world, seed, steps, lo, hi, prob)
        full, part = simulate("full", seq, world, **kw), simulate(mode, seq, world, **kw)
        per_seed.append([full[i - 1] / part[i - 1] for i in at])
    return [statistics.median(s[j] for s in per_seed) for j in range(len(at))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seeds", type=int, default=9, help="as many as tools/eager_sgd.py runs")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--at", type=int, nargs="+", default=[50, 100, 200], help="steps to report")
    ap.add_argument("--grace", type=float, nargs="+", default=[10.0], help="ms (activation_delay)")
    ap.add_argument("--compute", type=float, default=1.5, help="ms of compute per step")
    ap.add_argument("--overhead", type=float, default=0.3, help="ms a round takes")
    ap.add_argument("--max-staleness", type=int, default=8)
    ap.add_argument("--delay-lo", type=float, default=40.0, help="ms")
    ap.add_argument("--delay-hi", type=float, default=80.0, help="ms")
    ap.add_argument("--delay-prob", type=float, default=None,
                    help="each rank sleeps with this probability per step (default: one rank per step)")
    a = ap.parse_args(argv)
    at = [s for s in a.at if 1 <= s <= a.steps]
    print(f"full sync time / mode time at steps {at} (median of {a.seeds} seeds), model without "
          f"implementation cost: compute {a.compute:g} ms, round {a.overhead:g} ms, "
          f"max_staleness {a.max_staleness}; imbalance: "
          + ("one rank per step" if a.delay_prob is None else f"each rank with probability {a.delay_prob:g}"))
    for world in a.worlds:
        for mode in ("solo", "majority"):
            for grace in a.grace:
                s = speedups(world, mode, a.seeds, a.steps, at, compute=a.compute, grace=grace,
                             overhead=a.overhead, max_staleness=a.max_staleness,
                             delay_lo=a.delay_lo, delay_hi=a.delay_hi, delay_prob=a.delay_prob)
                print(f"world {world} {mode:8s} grace {grace:4g} ms: " + " / ".join(f"{x:.3f}x" for x in s))


if __name__ == "__main__":
    main()
