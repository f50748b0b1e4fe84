"""Fit ``alpha_crowded``: the tuner's price of a round with more busy ranks than cores.

    python tools/fit_crowded.py [--values 38,64,100,150,200,300,400]

Reads the interleaved world 3 and 4 all_reduce sweeps of docs/performance.md (every
algorithm timed in the same processes, 3 or 4 ranks on 2 vCPUs: the tables under "The same
sweeps at world 3 and 4") and prints, for each candidate value, the tuner's crossovers and
what its choice costs against each size's fastest (geometric mean and worst) and where it is
more than 10% slower than the old rule table's choice. docs/performance.md, "Crowded hosts",
has the result.
"""

from __future__ import annotations

import argparse
import math
from bisect import bisect_left
from dataclasses import replace
from pathlib import Path

from pycoll.core.tuner import DEFAULT_PARAMS, Tuner

DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
HEADER = "| size (B) | ring | recursive_doubling | halving_doubling | tree |"
ALGOS = ("ring", "recursive_doubling", "halving_doubling")   # tree: the tuner never picks it


def sweeps() -> dict[int, dict[int, dict[str, float]]]:
    """world -> size -> algorithm -> us: the tables after the world 3 and 4 caption."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("The same sweeps at world 3 and 4"))
    tables: list[dict] = []
    rows = None
    for line in lines[start:]:
        if line.startswith(HEADER):
            rows = {}
            tables.append(rows)
        elif rows is not None and line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0].isdigit():
                rows[int(cells[0])] = {a: float(c) for a, c in zip(ALGOS, cells[1:4])}
        elif rows is not None:          # the table ended
            rows = None
            if len(tables) == 2:
                break
    return {3: tables[0], 4: tables[1]}


def old_table(nbytes: int) -> str:
    return "recursive_doubling" if nbytes <= 16 << 10 else "halving_doubling" if nbytes <= 256 << 10 else "ring"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", default="38,64,100,150,200,300,400", help="alpha_crowded values, us")
    p.add_argument("--cores", type=int, default=2)
    args = p.parse_args()
    for world, rows in sweeps().items():
        def score(pick) -> tuple[float, float, list]:
            ratios = [rows[n][pick(n)] / min(rows[n].values()) for n in sorted(rows)]
            slower = [(n, round(rows[n][pick(n)] / rows[n][old_table(n)], 2)) for n in sorted(rows)
                      if rows[n][pick(n)] > 1.1 * rows[n][old_table(n)]]
            return math.exp(sum(map(math.log, ratios)) / len(ratios)), max(ratios), slower
        g, w, _ = score(old_table)
        print(f"world {world}: old rule table: geo-mean {g:.3f}, worst {w:.2f}")
        for us in (float(v) for v in args.values.split(",")):
            tuner = Tuner(world, params=replace(DEFAULT_PARAMS, alpha_crowded=us * 1e-6), cores=args.cores)
            bounds, names = tuner.table("all_reduce", world)
            g, w, slower = score(lambda n: names[bisect_left(bounds, n)])
            cross = ", ".join(f"{n} above {b} B" for b, n in zip(bounds, names[1:]))
            print(f"  alpha_crowded {us:g} us: {names[0]}, {cross}; geo-mean {g:.3f}, worst {w:.2f}; "
                  f"over 1.1x the old table at {slower or 'no size'}")


if __name__ == "__main__":
    main()
