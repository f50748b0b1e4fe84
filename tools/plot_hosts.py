"""Plot runs of the bench over emulated hosts: gloo time / pycoll time against size, and, for
shaped links, each backend's share of the link bound (bound / time), from the JSON files of
``python -m pycoll bench --hosts HxR --link RATE --json FILE`` (docs/performance.md, "Across
emulated hosts").

    python -m pycoll bench --hosts 4x1 --link 1gbit -c all_reduce -b 16 -e 64M -f 4 --json out/4x1.json
    ... --hosts 2x2 --link 1gbit --json out/2x2.json; ... --link none ...
    python tools/plot_hosts.py out/*.json -o docs/bench_hosts.png

Needs matplotlib (``pip install '.[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import sys


def label(meta: dict) -> str:
    h, r = meta["hosts"]
    return f"{h}x{r}, {meta['link'] if meta.get('link_Bps') else 'unshaped'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="bench JSON files of --hosts runs")
    p.add_argument("-c", "--collective", default="all_reduce")
    p.add_argument("-o", "--out", default="bench_hosts.png")
    a = p.parse_args(argv)
    from pycoll.cli.bench.report import require_matplotlib

    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for path in a.runs:
        doc = json.load(open(path))
        if not doc["meta"].get("hosts"):
            print(f"{path}: not a --hosts run", file=sys.stderr)
            return 2
        rows = doc["collectives"][a.collective]["rows"]
        sizes = [r["size"] for r in rows]
        name = label(doc["meta"])
        line, = left.plot(sizes, [r["speed_ratio"]["pycoll/gloo"] for r in rows], marker="o", label=name)
        if doc["meta"].get("link_Bps"):
            # the sizes where the link, not the per-message cost, sets the time (tbf's burst
            # lets a small message beat the bound); the largest size when a sweep stops short
            big = [r for r in rows if r["size"] >= min(1 << 20, sizes[-1]) and r.get("link_bound_us")]
            for b, style in (("pycoll", "-"), ("gloo", ":")):
                right.plot([r["size"] for r in big],
                           [r["link_bound_us"] / r["results"][b]["time_us"] for r in big],
                           marker="o", linestyle=style, color=line.get_color(), label=f"{b}, {name}")
    left.axhline(1.0, color="grey", linestyle="--", label="as fast as gloo")
    left.set_ylabel("gloo time / pycoll time")
    left.set_title(f"{a.collective} across emulated hosts")
    right.axhline(0.95, color="grey", linestyle="--", label="95% of the bound")
    right.set_ylabel("link bound / time")
    right.set_title("share of the link bound (shaped links, >= 1 MiB)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
