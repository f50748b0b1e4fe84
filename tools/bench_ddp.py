"""DDP benchmark: {torch DDP, ddp.DistributedDataParallel} x {gloo, pycoll}, one invocation.

    python tools/bench_ddp.py [--models mlp,convnet] [--world-size 2] [--rounds 5] [--steps 5]
        [--warmup 2] [--sweep 0.25,1,5,25,100] [--sweep-models mlp] [--staged] [--no-memory]
        [--json out/bench_ddp.json] [--plot PATH]
        [--loader-workers N [--batch B] [--sample-work K]] [--load N] [--threads 1|default]

Speed: ``world_size`` rank processes are started once (forkserver, torch preloaded) around a
TCPStore that the parent binds to port 0. Each rank opens a gloo default group and, when
pycoll imports and registers, a ``new_group(backend="pycoll")``. Configurations run
interleaved (the order rotates each round) so a noisy phase of this shared machine hits all
alike; each block is ``--steps`` timed training steps after warm-up, timed by the slowest
rank; the report gives medians over rounds. Baselines: ``independent`` (every rank trains
its own copy at once, no communication: the fair denominator on 2 vCPUs, see DESIGN.md) and
``single`` (rank 0 alone). ``--sweep`` times our DDP across bucket_cap_mb values on the
``--sweep-models`` (the paper's bucket-size finding) and plots the MLP's when matplotlib is
installed (extra ``plot``; ``--plot ""`` for none). ``--staged`` adds ours on pycoll with
ordinary buckets (``shared_buckets=False``). Every configuration is also printed against
``independent`` round by round (median and range of the per-round ratios).
Under load: ``--loader-workers N`` feeds the convnet from N DataLoader worker processes per
rank that make and augment each sample on the CPU (``tools/ddp_data.py``), as a vision job
does, so the ranks share the cores with their own input pipeline; ``--load N`` adds N busy
processes beside everything; ``--threads default`` leaves torch its default thread count (as
``mp.spawn`` without ``OMP_NUM_THREADS`` does) instead of one thread per rank. Loader mode
adds a ``floor`` configuration per backend: torch DDP whose hook moves one element per bucket,
so the ranks synchronise as DDP makes them and move no gradient (no transfer can beat it).
Memory: each configuration runs once more in fresh rank processes, reporting peak RSS per
rank (``resource.getrusage`` ru_maxrss), since a process's peak cannot be reset for the next.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `ddp` importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from tools.bench_ddp_report import IMPLS, plot_sweep, print_speed, summarise  # noqa: E402



# ---- models ---------------------------------------------------------------------------
def mlp() -> nn.Module:  # 25.2M parameters in 7 similar layers (no single dominant gradient)
    layers = [nn.Linear(1024, 2048), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))


def convnet() -> nn.Module:  # 0.9M parameters
    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), *block(128, 256),
                         nn.Flatten(), nn.Linear(256 * 2 * 2, 512), nn.ReLU(), nn.Linear(512, 10))


MODELS = {"mlp": (mlp, lambda: torch.randn(32, 1024)),
          "convnet": (convnet, lambda: torch.randn(32, 3, 32, 32))}


def nparams(name: str) -> int:
    return sum(p.numel() for p in MODELS[name][0]().parameters())


# ---- rank side ------------------------------------------------------------------------
def pycoll_available() -> tuple[bool, str]:
    try:
        import pycoll  # noqa: F401  (importing registers the backend)
    except Exception as e:  # noqa: BLE001
        return False, f"import pycoll failed: {type(e).__name__}: {e}"
    if "pycoll" not in dist.Backend.backend_list:
        return False, "pycoll imports but does not register the 'pycoll' backend"
    return True, ""


def _init(rank: int, world: int, port: int, timeout_s: float, threads: str = "1") -> None:
    if threads != "default":
        torch.set_num_threads(int(threads))  # world_size ranks share 2 vCPUs
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store,
                            timeout=timedelta(seconds=timeout_s))


def _agree(ok: bool) -> bool:
    t = torch.tensor([0 if ok else 1])
    dist.all_reduce(t)  # gloo default group, not the group under test
    return t.item() == 0


def _groups(want_pycoll: bool, timeout_s: float) -> tuple[dict, str]:
    groups, note = {"gloo": dist.new_group(backend="gloo")}, ""
    if want_pycoll:
        try:
            pycoll_available()  # this fresh process must import pycoll to register it
            group = dist.new_group(backend="pycoll", timeout=timedelta(seconds=timeout_s))
            ok = True
        except Exception as e:  # noqa: BLE001 - the column becomes n/a on every rank
            group, ok, note = None, False, f"new_group(backend='pycoll') failed: {type(e).__name__}: {e}"
        if _agree(ok):
            groups["pycoll"] = group
        else:
            note = note or "new_group(backend='pycoll') failed on another rank"
    return groups, note


def _wrap(impl: str, model: nn.Module, group, kw: dict) -> nn.Module:
    if impl == "torch":
        kw = {k: v for k, v in kw.items() if k != "first_bucket_cap_mb"}
        return nn.parallel.DistributedDataParallel(model, process_group=group, **kw)
    if impl in ("ours", "ours-staged"):
        from ddp import DistributedDataParallel
        if impl == "ours-staged":   # buckets in ordinary memory: the staged shared-memory path
            kw = {**kw, "shared_buckets": False}
        return DistributedDataParallel(model, process_group=group, **kw)
    if impl == "floor":
        return _sync_only(model, group)
    return model  # independent / single: no communication


def _sync_only(model: nn.Module, group) -> nn.Module:
    """torch DDP whose comm hook all-reduces one element per bucket and leaves the gradients
    alone: the ranks wait for each other as DDP makes them, and move no gradient. Its speed
    is the floor of synchronous DDP on that backend: what no faster transfer can beat."""
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)

    def hook(_, bucket):
        fut = dist.all_reduce(torch.zeros(1), group=group, async_op=True).get_future()
        return fut.then(lambda _: bucket.buffer())
    ddp.register_comm_hook(None, hook)
    return ddp


def _block(model_name: str, impl: str, group, kw: dict, steps: int, warmup: int,
           rank: int, probe=None, data=None) -> float | None:
    """Seconds for ``steps`` training steps on this rank (None: this rank sat it out);
    ``data``: an iterator of (inputs, labels) batches, else one fixed batch every step."""
    build, inputs = MODELS[model_name]
    torch.manual_seed(0)
    alone = impl == "single" and rank != 0
    model = None if alone else _wrap(impl, build(), group, kw)
    elapsed = None
    if model is not None:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = inputs(), torch.randint(0, 10, (32,))

        def step() -> None:
            nonlocal x, y
            if data is not None:
                x, y = next(data)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(warmup):
            step()
    dist.barrier()
    if model is not None:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - t0
        if probe is not None:
            probe()
    dist.barrier()
    return elapsed


def speed_rank(rank: int, world: int, port: int, opts: dict) -> dict:
    _init(rank, world, port, opts["timeout"], opts.get("threads", "1"))
    groups, note = _groups(opts["pycoll"], opts["timeout"])
    data = None
    if opts.get("loader") is not None:   # started after the groups, as a training script does
        from tools.ddp_data import batches
        data = batches(rank, opts["loader"], opts["batch"], opts["work"])
    times: dict[str, list] = {}
    configs = [(m, impl, be, {}) for m in opts["models"]
               for impl in ("independent", "single")
               for be in [None]]
    configs += [(m, impl, be, {}) for m in opts["models"] for be in groups for impl in IMPLS]
    if opts.get("loader") is not None:   # where the machine is shared, the floor is worth knowing
        configs += [(m, "floor", be, {}) for m in opts["models"] for be in groups]
    if opts.get("staged") and "pycoll" in groups:   # ours with ordinary buckets: before/after in one run
        configs += [(m, "ours-staged", "pycoll", {}) for m in opts["models"]]
    configs += [(m, "ours", be, {"bucket_cap_mb": cap}) for m in opts["sweep_models"]
                for cap in opts["sweep"] for be in groups]
    for r in range(opts["rounds"]):
        shift = r % len(configs)
        for m, impl, be, kw in configs[shift:] + configs[:shift]:
            key = json.dumps([m, impl, be, kw.get("bucket_cap_mb")])
            times.setdefault(key, []).append(_block(m, impl, groups.get(be), kw, opts["steps"],
                                                    opts["warmup"], rank, data=data))
    del data   # ends the loader's worker processes
    dist.destroy_process_group()
    return {"times": times, "pycoll": "pycoll" in groups, "note": note}


def memory_rank(rank: int, world: int, port: int, opts: dict) -> dict:
    _init(rank, world, port, opts["timeout"])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    groups, _ = _groups(opts["backend"] == "pycoll", opts["timeout"])
    group = groups.get(opts["backend"])
    if group is None:
        dist.destroy_process_group()
        return {"peak_mb": None}
    live: dict = {}
    _block(opts["model"], opts["impl"], group, opts["kw"], opts["steps"], 1, rank,
           probe=lambda: live.update(_rss_pss()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    dist.destroy_process_group()
    return {"peak_mb": peak / 1024, "base_mb": base / 1024, **live}


def _rss_pss() -> dict:
    """RSS and PSS now (MiB): PSS shares each shared page among the processes mapping it, so
    memory that the ranks share (pycoll's registered buckets) counts once across them."""
    got = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    got[key.lower() + "_mb"] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return got


def _by_name(rank: int, world: int, port: int, fn_name: str, opts: dict):
    return globals()[fn_name](rank, world, port, opts)


def run_ranks(fn_name: str, world: int, opts: dict, timeout_s: float, fresh: bool = False) -> list[dict]:
    """Run ``fn_name`` on ``world`` ranks; ``fresh``: spawned from scratch, with this
    process's current environment (the forkserver keeps the one it started with)."""
    from pycoll.testing import spawn

    # A rank with DataLoader workers must be allowed children: not a daemon (killed at the end).
    return spawn.run(_by_name, world, fn_name, opts, timeout=timeout_s, store_timeout=timeout_s,
                     context="spawn" if fresh else "forkserver", preload=["torch", "torch.distributed"],
                     daemon=opts.get("loader") is None)


MMAP_FIXED = "glibc.malloc.mmap_threshold=1048576"


def measure_memory(opts: dict, malloc_default: bool) -> list[dict]:
    """Peak RSS per rank of each configuration, each in fresh rank processes.

    Unless ``malloc_default``, the ranks run with a fixed glibc mmap threshold (1 MiB): freed
    large tensors then go back to the OS at once, so the peak measures live tensors rather
    than what glibc's adaptive threshold happens to keep on its heap. Both DDPs alike.
    """
    saved = os.environ.get("GLIBC_TUNABLES")
    if not malloc_default:
        os.environ["GLIBC_TUNABLES"] = ":".join(t for t in (saved, MMAP_FIXED) if t)
    try:
        return _measure_memory(opts, os.environ.get("GLIBC_TUNABLES", ""))
    finally:
        if saved is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = saved


def _measure_memory(opts: dict, tunables: str) -> list[dict]:
    rows = []
    configs = [("torch", {}), ("ours", {}), ("torch", {"gradient_as_bucket_view": True}),
               ("ours", {"gradient_as_bucket_view": True})]
    for m in opts["models"]:
        for impl, kw in configs:
            mo = {"model": m, "impl": impl, "kw": kw, "backend": "gloo", "steps": 3,
                  "timeout": opts["timeout"]}
            res = run_ranks("memory_rank", opts["world"], mo, opts["timeout"] + 60, fresh=True)
            rows.append({"model": m, "impl": impl, "view": bool(kw), "peak_mb": [r["peak_mb"] for r in res]})
    pyrows = []
    if opts.get("staged"):   # ours on pycoll, registered buckets against ordinary ones
        for m in opts["models"]:
            for impl, view in (("ours-staged", False), ("ours", False), ("ours-staged", True), ("ours", True)):
                mo = {"model": m, "impl": impl, "kw": {"gradient_as_bucket_view": True} if view else {},
                      "backend": "pycoll", "steps": 3, "timeout": opts["timeout"]}
                res = run_ranks("memory_rank", opts["world"], mo, opts["timeout"] + 60, fresh=True)
                pyrows.append({"model": m, "impl": impl, "view": view, "peak_mb": [r["peak_mb"] for r in res],
                               "pss_mb": [r.get("pss_mb") for r in res], "rss_mb": [r.get("rss_mb") for r in res]})
    print(f"\npeak RSS per rank (MiB, fresh processes, gloo, 3 steps, GLIBC_TUNABLES={tunables!r})")
    for m in opts["models"]:
        grads_mb = nparams(m) * 4 / 2**20
        got = {(r["impl"], r["view"]): max(r["peak_mb"]) for r in rows if r["model"] == m}
        print(f"{m}: gradients {grads_mb:.0f} MiB; " + ", ".join(
            f"{i}{'+view' if v else ''} {mb:.0f}" for (i, v), mb in got.items())
            + f"; ours/torch {got['ours', False] / got['torch', False]:.3f}"
            + f"; ours saves with view {got['ours', False] - got['ours', True]:.0f} MiB")
    if pyrows:
        print("\nours on pycoll, per rank (MiB, max over ranks): peak RSS; RSS and PSS after the steps "
              "(PSS counts a page the ranks share once across them)")
        for r in pyrows:
            print(f"{r['model']}: {r['impl']}{'+view' if r['view'] else ''}: peak RSS {max(r['peak_mb']):.0f}, "
                  f"RSS {max(x or 0 for x in r['rss_mb']):.0f}, PSS {max(x or 0 for x in r['pss_mb']):.0f}")
    return rows + pyrows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,convnet")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sweep", default="0.25,1,5,25,100", help="bucket_cap_mb values; '' for none")
    p.add_argument("--sweep-models", default="mlp", help="models the sweep runs on")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-pycoll", action="store_true")
    p.add_argument("--staged", action="store_true",
                   help="also time ours on pycoll with ordinary buckets (shared_buckets=False), and "
                        "measure pycoll's memory both ways")
    p.add_argument("--malloc-default", action="store_true",
                   help="memory runs without the fixed glibc mmap threshold")
    p.add_argument("--loader-workers", type=int, default=None,
                   help="feed the convnet from N DataLoader workers per rank doing CPU work per sample")
    p.add_argument("--batch", type=int, default=32, help="batch size in loader mode")
    p.add_argument("--sample-work", type=int, default=4,
                   help="augmentation passes per sample in loader mode (its CPU cost)")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the ranks")
    p.add_argument("--threads", default="1", help="torch threads per rank, or 'default'")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=str(REPO / "out" / "bench_ddp.json"))
    p.add_argument("--plot", default=str(REPO / "docs" / "ddp_bucket_sweep.png"))
    a = p.parse_args(argv)
    ok, note = (False, "(--no-pycoll)") if a.no_pycoll else pycoll_available()
    opts = {"models": [m for m in a.models.split(",") if m], "world": a.world_size,
            "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "pycoll": ok,
            "sweep": [float(c) for c in a.sweep.split(",") if c], "timeout": a.timeout,
            "sweep_models": [m for m in a.sweep_models.split(",") if m],
            "staged": a.staged and ok, "loader": a.loader_workers, "batch": a.batch,
            "work": a.sample_work, "threads": a.threads}
    if a.loader_workers is not None and opts["models"] != ["convnet"]:
        p.error("--loader-workers feeds images: use it with --models convnet")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, world size {a.world_size}, "
          f"threads per rank {a.threads}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    if a.loader_workers is not None:
        print(f"input: {a.loader_workers} DataLoader workers per rank, batch {a.batch}, "
              f"{a.sample_work} augmentation passes per sample")
    from pycoll.cli.bench.load import Busy
    with Busy(a.load) as load:
        results = run_ranks("speed_rank", a.world_size, opts, a.timeout * 4)
    print(f"load: {load.describe()}")
    opts["load_text"] = load.describe()
    opts["params"] = {m: nparams(m) for m in opts["models"]}
    summary = summarise(results, opts)
    print_speed(summary, opts, note or summary["note"])
    memory = [] if a.no_memory else measure_memory(opts, a.malloc_default)
    if opts["sweep"] and a.plot and "mlp" in opts["sweep_models"]:
        plot_sweep(summary, opts, a.plot)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"opts": opts, "speed": summary, "memory": memory}, indent=1))
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
