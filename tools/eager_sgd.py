"""eager-SGD at small scale: full sync vs solo vs majority partial all-reduce under load imbalance.

    python tools/eager_sgd.py                 # the full run (world 2 and 4, 9 seeds, ~13 min here)
    python tools/eager_sgd.py --quick         # a short run while developing

Data: scikit-learn's bundled digits (8x8 images, 10 classes; ``pip install .[experiments]``),
standardised, a fixed 70/30 split. Model: an MLP 64-256-256-10, SGD. Each rank draws its
own batches; every mode runs the same number of steps per rank (so sees the same samples).

Imbalance: each step one rank, drawn from a seeded RNG that every rank replays alike, sleeps
``U(delay_lo, delay_hi)`` ms before its forward pass (tens of ms against ~2 ms of compute, so
the injected imbalance dominates the noise of a shared 2-core machine); with
``--delay-prob p``, each rank independently with probability p instead. Full sync pays the
straggler's delay every step; partial modes let the others go on, up to ``max_staleness``
rounds ahead. What the rules allow at best on these very sequences, without implementation
cost: ``python tools/eager_sgd_model.py``.

Every rank of every mode runs with ``sys.setswitchinterval(0.001)`` (``--switch-interval``):
with Python's default 5 ms, a background thread that needs the GIL while the training
thread computes waits up to 5 ms per acquisition, which slows pycoll's own threads in
every mode, and the partial modes' progress thread most.

Measured per run: each rank's time at the end of each step; the time of step i is the
*latest* rank's (a model state counts as reached when every replica has reached it). Rank 0
keeps a parameter snapshot every ``eval_every`` steps, evaluated on the test set after the
run. Reported per mode: wall time to the target test accuracy and final accuracy (medians
over seeds), speed-up over full sync (median time over median time) with its range seed by
seed: the number of steps a mode needs to reach an accuracy varies by several steps from one
seed to the next, so a few seeds can mislead. ``--json`` keeps everything; ``--plot`` draws
docs/eager_sgd.png (matplotlib, optional).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `ddp` and `pycoll` importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from pycoll.testing import spawn  # noqa: E402
from tools.eager_sgd_model import stragglers  # noqa: E402

MODES = ("full", "solo", "majority")


def load_digits(split_seed: int = 0):
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError as e:  # pragma: no cover - the message names the extra
        raise SystemExit("tools/eager_sgd.py needs scikit-learn: pip install .[experiments]") from e
    d = sk_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(split_seed))
    x, y = x[perm], y[perm]
    n_train = int(0.7 * len(x))
    mean, std = x[:n_train].mean(0), x[:n_train].std(0) + 1e-3
    x = (x - mean) / std
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def accuracy(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


# ---- rank side ------------------------------------------------------------------------
class Run:
    """One training run (a mode, a seed) on this rank; ``advance`` runs some of its steps.

    The runs without imbalance advance in interleaved blocks (full, solo, majority, then solo,
    majority, full, ...: the order turns each cycle): their differences are a few percent,
    less than this machine's speed drifts within a minute, so each mode must see the same slow
    and fast phases, and hold each place in the cycle as often. Each block starts at a
    barrier; a run's clock counts only its own blocks."""

    def __init__(self, rank: int, world: int, mode: str, imbalance: bool, seed: int, o: dict, data) -> None:
        from ddp import DistributedDataParallel

        self.rank, self.world, self.mode, self.imbalance, self.seed, self.o = rank, world, mode, imbalance, seed, o
        self.xtr, self.ytr, self.xte, self.yte = data
        torch.manual_seed(seed)
        self.model = DistributedDataParallel(mlp(), sync=mode, max_staleness=o["max_staleness"],
                                             activation_delay=o["activation_delay"] / 1e3)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=o["lr"])
        self.loss_fn = nn.CrossEntropyLoss()
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank)
        self.steps = o["steps"] if imbalance else o["balanced_steps"]
        # ms each rank sleeps, per step: the same sequence on every rank, and in the model
        self.sleeps = stragglers(world, seed, self.steps, o["delay_lo"], o["delay_hi"], o["delay_prob"])
        self.step, self.clock, self.stamps, self.snaps = 0, 0.0, [], []

    def advance(self, n: int) -> None:
        o, rank = self.o, self.rank
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(min(n, self.steps - self.step)):
            delay_ms = self.sleeps[self.step][rank]
            if self.imbalance and delay_ms:
                time.sleep(delay_ms / 1e3)
            idx = torch.randint(0, len(self.xtr), (o["batch"],), generator=self.gen)
            loss = self.loss_fn(self.model(self.xtr[idx]), self.ytr[idx])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.stamps.append(self.clock + time.perf_counter() - t0)
            self.step += 1
            if rank == 0 and self.step % o["eval_every"] == 0:
                self.snaps.append([p.detach().clone() for p in self.model.module.parameters()])
        self.clock += time.perf_counter() - t0

    def finish(self) -> dict:
        rounds = None
        if self.model.partial is not None:
            p = self.model.partial
            infos = list(p.allreduce.history)[:self.steps]
            rounds = {"mean_count": statistics.fmean(i.count for i in infos),
                      "max_age": max(i.max_age for i in infos),
                      "waited": sum(1 for i in infos if i.required)}
            p.close()
        every: list = [None] * self.world
        dist.all_gather_object(every, self.stamps)
        if self.rank != 0:
            return {}
        return {"mode": self.mode, "imbalance": self.imbalance, "seed": self.seed, "world": self.world,
                "step_time": [max(s[i] for s in every) for i in range(self.steps)],
                "accs": self._test_accuracies(), "rounds": rounds}

    def _test_accuracies(self) -> list[float]:
        """Test accuracy of each snapshot, out of the timed blocks. Done here rather than in
        the parent: the snapshots of 9 seeds x 3 modes are gigabytes, their accuracies bytes."""
        model = mlp()
        accs = []
        for snap in self.snaps:
            with torch.no_grad():
                for p, v in zip(model.parameters(), snap):
                    p.copy_(v)
            accs.append(accuracy(model, self.xte, self.yte))
        self.snaps = []
        return accs


def run_modes(rank: int, world: int, imbalance: bool, seed: int, o: dict, data) -> list[dict]:
    """Every mode for one seed: whole runs one after the other under imbalance (blocks would
    resynchronise the ranks that partial modes let run ahead), interleaved blocks without."""
    if imbalance:
        out = []
        for mode in o["modes"]:
            run = Run(rank, world, mode, imbalance, seed, o, data)
            run.advance(run.steps)
            out.append(run.finish())
        return out
    runs = [Run(rank, world, mode, imbalance, seed, o, data) for mode in o["modes"]]
    cycle = 0
    while any(r.step < r.steps for r in runs):
        # The order turns by one each cycle: a block right after full sync's ran a few
        # percent slower at world 2 (whichever mode it was), so no mode may always hold
        # that place.
        for i in range(len(runs)):
            runs[(cycle + i) % len(runs)].advance(o["block"])
        cycle += 1
    return [r.finish() for r in runs]


def rank_main(rank: int, world: int, port: int, o: dict) -> list | None:
    import pycoll  # noqa: F401  registers the backend
    torch.set_num_threads(1)
    if o.get("switch_interval"):
        sys.setswitchinterval(o["switch_interval"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("pycoll", rank=rank, world_size=world, store=store,
                            timeout=timedelta(seconds=120))
    data = load_digits()
    out = []
    for imbalance in o["imbalance"]:
        for seed in range(o["seeds"]):
            out += run_modes(rank, world, imbalance, seed, o, data)
    dist.destroy_process_group()
    return out if rank == 0 else None


def run_world(world: int, o: dict, timeout_s: float = 900) -> list[dict]:
    return spawn.run(rank_main, world, o, timeout=timeout_s)[0]


# ---- report ---------------------------------------------------------------------------
def evaluate(runs: list[dict], o: dict) -> None:
    for r in runs:
        curve = []
        for j, acc in enumerate(r.pop("accs")):
            step = (j + 1) * o["eval_every"]
            curve.append((step, r["step_time"][step - 1], acc))
        r["curve"] = curve
        r["final_acc"] = curve[-1][2]
        r["time_to"] = {str(tg): next((t for _, t, a in curve if a >= tg), None) for tg in o["targets"]}
        r["total_time"] = r["step_time"][-1]
        gaps = [b - a for a, b in zip([0.0] + r["step_time"][:-1], r["step_time"])]
        r["median_step_ms"] = 1e3 * statistics.median(gaps)
        del r["step_time"]


def summarise(runs: list[dict], o: dict) -> list[dict]:
    rows = []
    keys = sorted({(r["world"], r["imbalance"]) for r in runs})
    for world, imb in keys:
        base, base_runs = None, []
        for mode in MODES:
            rs = [r for r in runs if (r["world"], r["imbalance"], r["mode"]) == (world, imb, mode)]
            if not rs:
                continue
            row = {"world": world, "imbalance": imb, "mode": mode, "runs": len(rs),
                   "time_to_s": {},
                   "total_time_s": statistics.median(r["total_time"] for r in rs),
                   "median_step_ms": statistics.median(r["median_step_ms"] for r in rs),
                   "final_acc": statistics.median(r["final_acc"] for r in rs)}
            for tg in rs[0]["time_to"]:
                ts = [r["time_to"][tg] for r in rs]
                row["time_to_s"][tg] = statistics.median(ts) if None not in ts else None  # all reached
            row["time_to_target_s"] = row["time_to_s"][str(o["target"])]   # the plot's
            if rs[0]["rounds"]:
                row["mean_count"] = statistics.fmean(r["rounds"]["mean_count"] for r in rs)
                row["max_age"] = max(r["rounds"]["max_age"] for r in rs)
            if mode == "full":
                base, base_runs = row, rs
            elif base is not None:
                row["time_ratio_total"] = row["total_time_s"] / base["total_time_s"]
                row["step_ratio"] = row["median_step_ms"] / base["median_step_ms"]
                row["speedup_to"] = {tg: (base["time_to_s"][tg] / t if t and base["time_to_s"][tg] else None)
                                     for tg, t in row["time_to_s"].items()}
                row["seed_speedups_to"] = {tg: per_seed_speedups(base_runs, rs, tg) for tg in row["time_to_s"]}
                row["acc_delta_points"] = 100 * (row["final_acc"] - base["final_acc"])
            rows.append(row)
    return rows


def per_seed_speedups(full_runs: list[dict], mode_runs: list[dict], target: str) -> list[float]:
    """Full sync's time to ``target`` over the mode's, seed by seed (same straggler sequence
    and batches): the spread the medians hide. Seeds where either never got there are left out."""
    full = {r["seed"]: r["time_to"][target] for r in full_runs}
    return sorted(full[r["seed"]] / r["time_to"][target] for r in mode_runs
                  if r["time_to"][target] and full.get(r["seed"]))


def table(rows: list[dict]) -> str:
    targets = list(rows[0]["time_to_s"]) if rows else []
    tnames = [f"{100 * float(t):.0f}%" for t in targets]
    out = ["| world | imbalance | mode | " + " | ".join(f"time to {n} (s)" for n in tnames) +
           " | median step (ms) | total (s) | final acc | " +
           " | ".join(f"speed-up to {n} (seeds min-max)" for n in tnames) +
           " | step vs full | total vs full | acc vs full (pts) | deposits/round | max age |",
           "|---" * (11 + 2 * len(targets)) + "|"]

    def f(v, fmt, suffix=""):
        return "n/a" if v is None else format(v, fmt) + suffix

    def speedup_cell(v, seeds):
        spread = f" ({seeds[0]:.2f}-{seeds[-1]:.2f})" if len(seeds) > 1 else ""
        return f(v, ".2f", "x") + spread
    for r in rows:
        sp = r.get("speedup_to", {})
        out.append(f"| {r['world']} | {'yes' if r['imbalance'] else 'no'} | {r['mode']} | "
                   + " | ".join(f(r["time_to_s"][t], ".2f") for t in targets) +
                   f" | {r['median_step_ms']:.2f} | {r['total_time_s']:.2f} | {100 * r['final_acc']:.1f}% | "
                   + " | ".join(speedup_cell(sp.get(t), r.get("seed_speedups_to", {}).get(t, []))
                                if r["mode"] != "full" else "" for t in targets) +
                   f" | {f(r.get('step_ratio'), '.3f')} | {f(r.get('time_ratio_total'), '.3f')} | "
                   f"{f(r.get('acc_delta_points'), '+.1f')} | "
                   f"{f(r.get('mean_count'), '.2f')} | {r.get('max_age', 'n/a')} |")
    return "\n".join(out)


def plot(runs: list[dict], rows: list[dict], path: Path, o: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in runs})
    fig, axes = plt.subplots(1, len(worlds) + 1, figsize=(5 * (len(worlds) + 1), 4))
    colors = {"full": "tab:gray", "solo": "tab:red", "majority": "tab:blue"}
    for ax, world in zip(axes, worlds):
        for r in runs:
            if r["world"] == world and r["imbalance"]:
                t = [c[1] for c in r["curve"]]
                a = [100 * c[2] for c in r["curve"]]
                ax.plot(t, a, color=colors[r["mode"]], alpha=0.7,
                        label=r["mode"] if r["seed"] == 0 else None)
        ax.axhline(100 * o["target"], color="k", lw=0.6, ls="--")
        ax.set(title=f"world {world}, imbalanced", xlabel="wall time (s)", ylabel="test accuracy (%)",
               ylim=(70, 100))
        ax.legend()
    ax = axes[-1]
    labels, vals, cols = [], [], []
    for r in rows:
        if r["time_to_target_s"] is not None:
            labels.append(f"w{r['world']} {'imb' if r['imbalance'] else 'bal'}\n{r['mode']}")
            vals.append(r["time_to_target_s"])
            cols.append(colors[r["mode"]])
    ax.barh(range(len(vals)), vals, color=cols)
    ax.set_yticks(range(len(vals)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(title=f"time to {100 * o['target']:.0f}% (median of {o['seeds']} seeds)", xlabel="s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--seeds", type=int, default=9,
                    help="time to an accuracy varies a lot from seed to seed (the table shows the spread)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--balanced-steps", type=int, default=600,
                    help="steps of the runs without imbalance (short steps: more of them for a stable time)")
    ap.add_argument("--block", type=int, default=5,
                    help="steps per block of the interleaved runs without imbalance")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--max-staleness", type=int, default=8)
    ap.add_argument("--activation-delay", type=float, default=10.0,
                    help="ms an initiator waits in its all-reduce before it activates the others")
    ap.add_argument("--delay-lo", type=float, default=40.0, help="ms")
    ap.add_argument("--delay-hi", type=float, default=80.0, help="ms")
    ap.add_argument("--delay-prob", type=float, default=None,
                    help="each rank sleeps with this probability per step (default: one rank per step)")
    ap.add_argument("--target", type=float, default=0.95, help="the plot's target")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.90, 0.93, 0.95],
                    help="report time to each of these test accuracies")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--imbalance", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--quick", action="store_true", help="world 2, one seed, 100 steps")
    ap.add_argument("--switch-interval", type=float, default=0.001,
                    help="sys.setswitchinterval in every rank, every mode (0: leave Python's 5 ms)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, nargs="?", const=REPO / "docs" / "eager_sgd.png")
    a = ap.parse_args(argv)
    if a.quick:
        a.worlds, a.seeds, a.steps, a.balanced_steps = [2], 1, 100, 200
    o = {"steps": a.steps, "balanced_steps": a.balanced_steps, "block": a.block, "batch": a.batch, "lr": a.lr,
         "max_staleness": a.max_staleness, "activation_delay": a.activation_delay,
         "delay_lo": a.delay_lo, "delay_hi": a.delay_hi, "delay_prob": a.delay_prob, "target": a.target,
         "targets": sorted(set(a.targets) | {a.target}), "eval_every": a.eval_every,
         "switch_interval": a.switch_interval, "seeds": a.seeds, "modes": a.modes,
         "imbalance": {"both": [False, True], "yes": [True], "no": [False]}[a.imbalance]}
    t0 = time.perf_counter()
    runs = []
    for world in a.worlds:
        runs += run_world(world, o)
        print(f"world {world} done at {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    evaluate(runs, o)
    rows = summarise(runs, o)
    print(f"{a.steps} steps (balanced: {a.balanced_steps}) x batch {a.batch} per rank; "
          f"imbalance: {'one rank per step' if a.delay_prob is None else f'each rank with probability {a.delay_prob:g}'}"
          f" sleeps U({a.delay_lo:g}, {a.delay_hi:g}) ms; "
          f"max_staleness {a.max_staleness}; medians of {a.seeds} seeds; {time.perf_counter() - t0:.0f}s")
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps({"options": o, "rows": rows, "runs": runs}, indent=1))
    if a.plot:
        try:
            plot(runs, rows, a.plot, o)
            print(f"plot: {a.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot (pip install .[plot])", file=sys.stderr)


if __name__ == "__main__":
    main()
