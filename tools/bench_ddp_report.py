"""The report of ``tools/bench_ddp.py``: steps/s per configuration, ratios round by round,
pycoll against gloo, and the bucket-size sweep's plot. Pure functions of the ranks' times."""

from __future__ import annotations

import json
import statistics

IMPLS = ("torch", "ours")


def _round_rates(per_rank: list[list], steps: int) -> list[float]:
    """Steps/s of each round, each round timed by its slowest rank."""
    return [steps / max(t for t in ts if t is not None) for ts in zip(*per_rank)]


def summarise(results: list[dict], opts: dict) -> dict:
    per_round = {key: _round_rates([r["times"][key] for r in results], opts["steps"])
                 for key in results[0]["times"]}
    rates = {key: statistics.median(v) if v else None for key, v in per_round.items()}
    notes = [r["note"] for r in results if r["note"]]
    return {"rates": rates, "per_round": per_round, "pycoll": results[0]["pycoll"],
            "note": notes[0] if notes else ""}


def _rate(rates: dict, m: str, impl: str, be, cap=None) -> float | None:
    return rates.get(json.dumps([m, impl, be, cap]))


def _fmt(x: float | None, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.2f}{unit}"


def print_speed(summary: dict, opts: dict, note: str) -> None:
    rates = summary["rates"]
    print(f"\nsteps/s, world size {opts['world']}, median of {opts['rounds']} rounds x "
          f"{opts['steps']} steps (slowest rank); pycoll: {'yes' if summary['pycoll'] else 'n/a ' + note}")
    head = ["model", "params", "single", "indep.", "torch/gloo", "ours/gloo", "torch/pycoll",
            "ours/pycoll", "ours/torch gloo", "ours-pycoll/torch-gloo", "eff.(ours gloo)"]
    print(" | ".join(head))
    for m in opts["models"]:
        g = {(i, b): _rate(rates, m, i, b) for i in IMPLS for b in ("gloo", "pycoll")}
        indep = _rate(rates, m, "independent", None)
        ratio = (lambda a, b: None if a is None or b is None else a / b)
        row = [m, f"{opts['params'][m] / 1e6:.1f}M", _fmt(_rate(rates, m, "single", None)), _fmt(indep),
               _fmt(g["torch", "gloo"]), _fmt(g["ours", "gloo"]), _fmt(g["torch", "pycoll"]),
               _fmt(g["ours", "pycoll"]), _fmt(ratio(g["ours", "gloo"], g["torch", "gloo"])),
               _fmt(ratio(g["ours", "pycoll"], g["torch", "gloo"])),
               _fmt(ratio(g["ours", "gloo"], indep))]
        print(" | ".join(row))
    if opts.get("staged"):
        print("\nours on pycoll: registered buckets (default) against ordinary buckets (staged path)")
        print("model | ours/pycoll | ours-staged/pycoll | registered/staged | ours-pycoll/indep. | staged/indep.")
        for m in opts["models"]:
            reg, st = _rate(rates, m, "ours", "pycoll"), _rate(rates, m, "ours-staged", "pycoll")
            indep = _rate(rates, m, "independent", None)
            ratio = (lambda a, b: None if a is None or b is None else a / b)
            print(" | ".join([m, _fmt(reg), _fmt(st), _fmt(ratio(reg, st)), _fmt(ratio(reg, indep)),
                              _fmt(ratio(st, indep))]))
    for m in opts["sweep_models"] if opts["sweep"] else []:
        print(f"\nbucket_cap_mb sweep, ours on the {m}, steps/s")
        for be in ("gloo", "pycoll"):
            print(f"{be:7s}", "  ".join(f"{cap:g}MB: {_fmt(_rate(rates, m, 'ours', be, cap))}"
                                         for cap in opts["sweep"]))
    print_round_ratios(summary, opts)


def print_round_ratios(summary: dict, opts: dict) -> None:
    """Each configuration against ``independent`` round by round (the rounds run every
    configuration seconds apart, so a ratio within a round is steadier than the ratio of
    medians on a machine whose speed drifts): the median and range of those ratios."""
    per_round = summary["per_round"]
    print("\nagainst independent, per round: median [min-max]")
    for m in opts["models"]:
        base = per_round.get(json.dumps([m, "independent", None, None]))
        if not base:
            continue
        cells = []
        for key, rates in per_round.items():
            km, impl, be, cap = json.loads(key)
            if km != m or impl in ("independent", "single") or not rates:
                continue
            ratios = [r / b for r, b in zip(rates, base)]
            name = f"{impl}/{be}" + ("" if cap is None else f"@{cap:g}MB")
            cells.append(f"{name} {statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]")
        print(f"{m}: " + "; ".join(cells))
        print_pycoll_vs_gloo(per_round, m)


def print_pycoll_vs_gloo(per_round: dict, m: str) -> None:
    """pycoll against gloo for each DDP: the ratio round by round (each round runs both
    seconds apart), and how much of gloo's distance to ``independent`` pycoll closes."""
    indep = per_round.get(json.dumps([m, "independent", None, None]))
    floor = {be: per_round.get(json.dumps([m, "floor", be, None])) for be in ("gloo", "pycoll")}
    if all(floor.values()) and indep:
        print(f"{m}: synchronisation floor (torch DDP moving one element per bucket) against independent: "
              + ", ".join(f"{be} {statistics.median(f) / statistics.median(indep):.3f}" for be, f in floor.items()))
    for impl in IMPLS:
        g, p = (per_round.get(json.dumps([m, impl, be, None])) for be in ("gloo", "pycoll"))
        if not g or not p or not indep:
            continue
        ratios = [b / a for a, b in zip(g, p)]
        gm, pm, im = (statistics.median(v) for v in (g, p, indep))
        closed = "n/a (gloo at or above independent)" if im <= gm else f"{(pm - gm) / (im - gm):.0%}"
        print(f"{m}, {impl} DDP: pycoll/gloo per round {' '.join(f'{r:.2f}' for r in ratios)} "
              f"(above gloo in {sum(r > 1 for r in ratios)} of {len(ratios)}); pycoll closes "
              f"{closed} of gloo's distance to independent")


def plot_sweep(summary: dict, opts: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed; pip install '.[plot]' to get {path})")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for be in ("gloo", "pycoll"):
        ys = [_rate(summary["rates"], "mlp", "ours", be, cap) for cap in opts["sweep"]]
        if any(y is not None for y in ys):
            ax.plot(opts["sweep"], ys, marker="o", label=f"ddp on {be}")
    refs = [("torch DDP on gloo (25 MB)", _rate(summary["rates"], "mlp", "torch", "gloo"), "--"),
            ("independent ranks (no communication)", _rate(summary["rates"], "mlp", "independent", None), ":")]
    for label, y, style in refs:
        if y is not None:
            ax.axhline(y, linestyle=style, color="grey", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("steps/s (25M-parameter MLP)")
    ax.set_title(f"Bucket size vs throughput, world size {opts['world']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
