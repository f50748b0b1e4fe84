"""Combining per-rank records into figures, and printing them: tables, JSON, optional plot.

Ranks are combined as nccl-tests does: an iteration's time is the mean over the ranks that took
part, the reported time is the median of those over iterations. algbw = bytes / time, busbw =
algbw * the collective's bus factor (GB/s = 1e9 bytes/s). #wrong sums the wrong elements over
ranks and over the checked iterations. The speed ratio X/base is time(base) / time(X): above 1,
X is faster.
"""

from __future__ import annotations

import statistics

from pycoll.cli.bench.collectives import COLLECTIVES


def _summary(recs: list[dict], nbytes: int, factor: float) -> dict:
    """One backend's figures at one size, from its per-rank records."""
    err = next((r["error"] for r in recs if r["error"] and "another rank" not in r["error"]),
               next((r["error"] for r in recs if r["error"]), None))
    n = min(len(r["times_us"]) for r in recs)
    per_iter = []
    for i in range(n):
        ts = [r["times_us"][i] for r in recs if r["times_us"][i] is not None]
        if ts:
            per_iter.append(sum(ts) / len(ts))
    out = {"wrong": sum(r["wrong"] for r in recs), "error": err, "iters": len(per_iter)}
    if per_iter and not err:
        t = statistics.median(per_iter)
        algbw = nbytes / (t * 1e-6) / 1e9 if t > 0 and nbytes else 0.0
        out.update(time_us=t, time_us_min=min(per_iter), time_us_max=max(per_iter),
                   algbw_GBps=algbw, busbw_GBps=algbw * factor, times_us=per_iter)
    return out


def merge(docs: list[dict], world: int, order: list[str], coll_order: list[str]) -> dict:
    """Per-rank documents (torch and MPI ranks alike) -> {"collectives": ..., "notes": ...}."""
    by_key: dict[tuple, list] = {}
    notes: dict[str, str] = {}
    info: dict[str, str] = {}
    for d in docs:
        notes.update(d.get("notes", {}))
        info.update(d.get("info", {}))
        for r in d["records"]:
            by_key.setdefault((r["collective"], r["size"], r["count"], r["backend"]), []).append(r)
    base = "gloo" if "gloo" in order else order[-1]
    colls: dict[str, dict] = {}
    for (name, size, count, b), recs in sorted(by_key.items(), key=lambda kv: kv[0][:3]):
        coll = COLLECTIVES[name]
        entry = colls.setdefault(name, {"bus_factor": coll.bus_factor(world),
                                        "factor_text": coll.factor_text, "rows": []})
        if not entry["rows"] or entry["rows"][-1]["size"] != size:
            entry["rows"].append({"size": size, "count": count,
                                  "results": {x: None for x in order}, "speed_ratio": {}})
        entry["rows"][-1]["results"][b] = _summary(recs, size, coll.bus_factor(world))
    for entry in colls.values():
        for row in entry["rows"]:
            res = row["results"]
            t_base = (res.get(base) or {}).get("time_us")
            for b in order:
                t = (res.get(b) or {}).get("time_us")
                if b != base and t and t_base:
                    row["speed_ratio"][f"{b}/{base}"] = t_base / t
    colls = {name: colls[name] for name in coll_order if name in colls}  # the user's order
    return {"base": base, "collectives": colls, "notes": notes, "info": info}


def _fmt(v, width: int, prec: int) -> str:
    return f"{v:>{width}.{prec}f}" if isinstance(v, (int, float)) else f"{v:>{width}}"


def format_tables(result: dict, order: list[str]) -> str:
    """nccl-tests-like text: one table per collective, backends side by side, ratio columns."""
    m = result["meta"]
    base = result["base"]
    others = [b for b in order if b != base]
    lines = []
    for name, entry in result["collectives"].items():
        lines.append("")
        what = ("latency only" if name == "barrier" else
                f"busbw = algbw * {entry['factor_text']} = {entry['bus_factor']:.3f}")
        if name == "sendrecv":
            what += ", time = half a ping-pong round trip"
        lines.append(f"# {name}  world {m['world_size']}  {m['dtype']}  op {m['op']}  "
                     f"root 0  {what}")
        bounded = bool(m.get("link_Bps"))
        head1 = "#" + " " * (35 if bounded else 23)
        head2 = f"#{'size(B)':>11} {'count':>11}" + (f" {'bound(us)':>11}" if bounded else "")
        for b in order:
            head1 += f" {b:^39}"
            head2 += f" {'time(us)':>11} {'algbw':>8} {'busbw':>8} {'#wrong':>9}"
        for b in others:
            head1 += f" {'':>12}"
            head2 += f" {b + '/' + base:>12}"
        lines += [head1.rstrip(), head2]
        for row in entry["rows"]:
            line = f" {row['size']:>11} {row['count']:>11}"
            if bounded:
                bound = row.get("link_bound_us")
                line += f" {_fmt(bound if bound is not None else '-', 11, 1)}"
            for b in order:
                r = row["results"].get(b)
                if r is None:
                    line += f" {'n/a':>11} {'':>8} {'':>8} {'':>9}"
                elif "time_us" not in r:
                    line += f" {'error':>11} {'':>8} {'':>8} {r['wrong']:>9}"
                else:
                    bw = ("-", "-") if name == "barrier" else (r["algbw_GBps"], r["busbw_GBps"])
                    line += (f" {_fmt(r['time_us'], 11, 1)} {_fmt(bw[0], 8, 3)}"
                             f" {_fmt(bw[1], 8, 3)} {r['wrong']:>9}")
            for b in others:
                ratio = row["speed_ratio"].get(f"{b}/{base}")
                line += f" {_fmt(ratio if ratio is not None else '-', 12, 2)}"
            lines.append(line)
        errors = {b: r["error"] for row in entry["rows"] for b, r in row["results"].items()
                  if r and r.get("error")}
        for b, e in errors.items():
            lines.append(f"#   {b}: {e}")
    avg = []
    for b in order:  # nccl-tests' closing figure: mean busbw over every row that has one
        bws = [row["results"][b]["busbw_GBps"] for e in result["collectives"].values()
               for row in e["rows"] if (row["results"].get(b) or {}).get("busbw_GBps")]
        if bws:
            avg.append(f"{b} {sum(bws) / len(bws):.3f}")
    lines.append(f"\n# avg busbw (GB/s, over all sizes and collectives): {', '.join(avg) or '-'}")
    return "\n".join(lines)


def format_header(result: dict, order: list[str]) -> str:
    m, ref = result["meta"], result["reference"]
    lines = [f"# pycoll bench: backends {', '.join(order)}  world {m['world_size']}  "
             f"dtype {m['dtype']}  op {m['op']}  iters {m['iters']} (in {m['rounds']} "
             f"interleaved rounds)  warmup {m['warmup']}  timing {m.get('timing', 'each')}",
             "# time: median over iterations of the per-iteration mean over ranks; "
             "GB/s = 1e9 B/s; ratio X/base = time(base)/time(X), > 1: X faster"]
    if m.get("hosts"):
        h, r = m["hosts"]
        link = (f"each host's link shaped to {m['link']} ({m['link_Bps'] / 1e6:.1f} MB/s) each way"
                if m.get("link_Bps") else "links unshaped (veth)")
        lines.append(f"# emulated hosts {h}x{r}: {h} network namespaces, {r} rank(s) each; {link}")
        if m.get("link_Bps"):
            lines.append("# bound(us): the least time the links allow: what one host's link must "
                         "carry (all_reduce 2(H-1)/H * S, all_gather/reduce_scatter (H-1)/H * S, "
                         "broadcast/reduce S) / the link rate")
    if "load_text" in m:
        lines.append(f"# load: {m['load_text']} beside the ranks")
    if ref:
        lines.append(f"# reference, this run: loopback TCP {ref['tcp_loopback_one_way_GBps']:.2f}"
                     f" GB/s one way, {ref['tcp_loopback_each_way_bidir_GBps']:.2f} GB/s each way"
                     f" both ways at once; memcpy {ref['memcpy_GBps']:.2f} GB/s (64 MiB copy_)")
        if "memcpy_per_rank_GBps" in ref:
            seen = ref.get("memcpy_per_rank_before_after_GBps")
            when = f" (best of {seen[0]:.2f} before and {seen[1]:.2f} after the ranks)" if seen else ""
            lines.append(f"# reference, this run: {ref['memcpy_per_rank_GBps']:.2f} GB/s copied by each "
                         f"of {m['world_size']} one-thread processes at once{when}; one-host all_reduce "
                         f"busbw bound {ref['all_reduce_shm_bound_busbw_GBps']:.2f} GB/s "
                         f"(one copy per rank, docs/performance.md)")
    for b, text in result["info"].items():
        lines.append(f"# {b}: {text}")
    for b, text in result["notes"].items():
        lines.append(f"# note: {b} column is n/a: {text}")
    for text in m.get("notes", []):
        lines.append(f"# note: {text}")
    return "\n".join(lines)


def require_matplotlib():
    """Import matplotlib lazily (optional dependency) with a clear message when it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed: we only write a file
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib, which is not installed ({e}); "
                         "install it with: pip install 'pycoll[plot]'  (or: pip install "
                         "matplotlib)") from None
    return plt


def plot(result: dict, order: list[str], path: str) -> None:
    """busbw vs size per collective (barrier: latency per backend), one panel each."""
    plt = require_matplotlib()
    names = list(result["collectives"])
    cols = min(3, len(names)) or 1
    rows = (len(names) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        entry = result["collectives"][name]
        for b in order:
            pts = [(row["size"], (row["results"].get(b) or {}).get("busbw_GBps"),
                    (row["results"].get(b) or {}).get("time_us")) for row in entry["rows"]]
            pts = [p for p in pts if p[2] is not None]
            if name == "barrier":
                if pts:
                    ax.bar(b, pts[0][2])
                continue
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=b)
        tcp = result["reference"].get("tcp_loopback_one_way_GBps")
        if tcp and name != "barrier":  # the bound for a TCP-only path, measured in this run
            ax.axhline(tcp, color="grey", ls="--", lw=1, label="TCP loopback")
        if name == "barrier":
            ax.set_ylabel("time (us)")
        else:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel("busbw (GB/s)")
            ax.legend(fontsize=8)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    m = result["meta"]
    fig.suptitle(f"world {m['world_size']}, {m['dtype']}, op {m['op']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
