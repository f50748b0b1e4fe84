"""Plot gloo time / pycoll time against message size, one line per load, from the JSON files
of ``python -m pycoll bench --load N --json FILE`` runs (docs/performance.md, "Waits under load").

    python -m pycoll bench -c all_reduce -b 16 -e 64M -f 4 --mpi off --load 0 --json out/load0.json
    ... --load 1 --json out/load1.json; ... --load 2 --json out/load2.json
    python tools/plot_load.py out/load0.json out/load1.json out/load2.json -o docs/bench_load_w2.png

Needs matplotlib (``pip install '.[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import sys


def ratios(path: str, collective: str) -> tuple[str, list[int], list[float]]:
    doc = json.load(open(path))
    rows = doc["collectives"][collective]["rows"]
    sizes = [r["size"] for r in rows]
    # the bench's own ratio against its base backend: gloo time / pycoll time
    return doc["meta"].get("load_text", path), sizes, [r["speed_ratio"]["pycoll/gloo"] for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="bench JSON files, one per load")
    p.add_argument("-c", "--collective", default="all_reduce")
    p.add_argument("-o", "--out", default="bench_load.png")
    a = p.parse_args(argv)
    from pycoll.cli.bench.report import require_matplotlib

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    for path in a.runs:
        label, sizes, r = ratios(path, a.collective)
        ax.plot(sizes, r, marker="o", label=label.split(" (")[0])
    ax.axhline(1.0, color="grey", linestyle="--", label="as fast as gloo")
    ax.axhline(2.0, color="grey", linestyle=":", label="2x gloo")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("gloo time / pycoll time")
    ax.set_title(f"{a.collective}, world 2, busy processes beside the ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"plot: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
