"""``python -m pycoll trace DIR``: merge the ranks' PYCOLL_TRACE files into one Chrome trace.

Reads ``DIR/rank*.jsonl`` (see ``pycoll/observe/trace.py``), moves every rank's events onto rank 0's
clock with the offset measured when the group was created, and writes a Chrome / Perfetto
trace (JSON object format): one process per rank, one thread per process group, every
collective, step and shared-memory phase a complete ("X") event with its details in
``args``. Open it in https://ui.perfetto.dev or chrome://tracing. ``--png`` draws a timeline
(needs matplotlib). It also prints the straggler attribution the trace implies.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from pycoll.observe.stragglers import attribute, format_report


def load(directory: str) -> dict[int, dict]:
    """rank -> {"meta": ..., "groups": {g: record}, "events": [...]} from DIR/rank*.jsonl."""
    ranks = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.jsonl"))):
        m = re.fullmatch(r"rank(\d+)\.jsonl", os.path.basename(path))
        if not m:
            continue
        rank = int(m.group(1))
        info = {"meta": {"rank": rank, "offset_s": 0.0, "error_s": 0.0}, "groups": {}, "events": []}
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                kind = rec.get("type")
                if kind == "meta":
                    info["meta"] = rec
                elif kind == "group":
                    info["groups"][rec["g"]] = rec
                else:
                    info["events"].append(rec)
        ranks[rank] = info
    if not ranks:
        raise FileNotFoundError(f"no rank*.jsonl files in {directory} (was PYCOLL_TRACE={directory} set?)")
    return ranks


def _name(ev: dict) -> str:
    if ev["k"] == "op":
        return f"{ev['op']} #{ev['seq']}"
    if ev["k"] == "step":
        return f"{ev['algo']} step {ev['step']}"
    return "stage/reduce"


def to_chrome(ranks: dict[int, dict]) -> dict:
    """The merged trace as a Chrome trace-event JSON object."""
    offset = {r: float(info["meta"].get("offset_s", 0.0)) for r, info in ranks.items()}
    base = min((ev["t0"] + offset[r] for r, info in ranks.items() for ev in info["events"]), default=0.0)

    def us(r: int, t: float) -> float:
        return round((t + offset[r] - base) * 1e6, 3)

    out = []
    for r, info in sorted(ranks.items()):
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for g, grp in info["groups"].items():
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": g,
                        "args": {"name": f"group {g} ({grp['mode']}, rank {grp['rank']} of {grp['world']})"}})
        evs = []
        for ev in info["events"]:
            args = {k: v for k, v in ev.items() if k not in ("k", "g", "t0", "t1", "tb")}
            if ev["k"] == "shm":
                tb = ev["tb"]
                evs.append(_x("stage/reduce", "shm", us(r, ev["t0"]), us(r, tb), r, ev["g"], args))
                evs.append(_x(f"barrier {ev['barrier']}", "shm", us(r, tb), us(r, ev["t1"]), r, ev["g"],
                              {"op": ev["op"], "seq": ev["seq"], "round": ev["round"]}))
                continue
            cat = "collective" if ev["k"] == "op" else "step"
            evs.append(_x(_name(ev), cat, us(r, ev["t0"]), us(r, ev["t1"]), r, ev["g"], args))
        evs.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
        out.extend(evs)
    clocks = {str(r): {k: info["meta"].get(k) for k in ("offset_s", "error_s", "method")}
              for r, info in sorted(ranks.items())}
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"producer": "pycoll trace", "clock": "rank 0 monotonic", "clocks": clocks}}


def _x(name, cat, ts, end, pid, tid, args) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": max(0.0, round(end - ts, 3)),
            "pid": pid, "tid": tid, "args": args}


def stragglers_from(ranks: dict[int, dict], group: int = 0) -> dict | None:
    """Straggler attribution from the traced collectives of ``group`` (all its ranks traced)."""
    per_rank, ops = {}, {}
    for r, info in ranks.items():
        grp = info["groups"].get(group)
        if grp is None:
            continue
        off = float(info["meta"].get("offset_s", 0.0))
        per_rank[grp["rank"]] = {ev["seq"]: (ev["t0"] + off, ev["t1"] + off)
                                 for ev in info["events"] if ev["k"] == "op" and ev["g"] == group}
        ops.update({ev["seq"]: ev["op"] for ev in info["events"] if ev["k"] == "op" and ev["g"] == group})
        world = grp["world"]
    if not per_rank or len(per_rank) != world:
        return None
    report = attribute([per_rank[i] for i in range(world)], ops)
    report["clock"] = {"error_s": [float(info["meta"].get("error_s", 0.0)) for info in ranks.values()]}
    return report


def draw(ranks: dict[int, dict], trace: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = sorted({e["args"].get("op", "?") for e in xs})
    cmap = plt.get_cmap("tab10")
    color = {n: cmap(i % 10) for i, n in enumerate(names)}
    pids = sorted(ranks)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(pids)))
    for e in xs:
        y = pids.index(e["pid"])
        c = color[e["args"].get("op", "?")]
        ts, dur = e["ts"] / 1e3, e["dur"] / 1e3
        if e["cat"] == "collective":
            ax.barh(y, dur, left=ts, height=0.7, color=c, alpha=0.35, edgecolor=c)
        elif e["name"].startswith("barrier"):
            ax.barh(y - 0.2, dur, left=ts, height=0.2, color="grey")
        else:
            ax.barh(y + 0.1, dur, left=ts, height=0.35, color=c, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(pids)), [f"rank {p}" for p in pids])
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title("pycoll trace: collectives (light), steps / staging (dark), shm barrier waits (grey)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=color[n], label=n) for n in names], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pycoll trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the PYCOLL_TRACE directory (holds rank*.jsonl)")
    ap.add_argument("-o", "--output", help="Chrome trace JSON to write (default: DIR/trace.json)")
    ap.add_argument("--png", help="also draw a timeline picture here (matplotlib)")
    args = ap.parse_args(argv)
    ranks = load(args.dir)
    trace = to_chrome(ranks)
    out = args.output or os.path.join(args.dir, "trace.json")
    with open(out, "w") as f:
        json.dump(trace, f)
    n = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"wrote {out}: {len(ranks)} ranks, {n} events (open in https://ui.perfetto.dev)")
    for r, c in trace["otherData"]["clocks"].items():
        print(f"  rank {r}: clock offset {c['offset_s'] or 0.0:+.6f} s, error <= {c['error_s'] or 0.0:.6f} s "
              f"({c['method']})")
    report = stragglers_from(ranks)
    if report is not None and report["collectives"]:
        print(format_report(report))
    if args.png:
        draw(ranks, trace, args.png)
        print(f"wrote {args.png}")
    return 0
