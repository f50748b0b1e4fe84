"""Backend-comparison benchmark in the style of nccl-tests: pycoll vs gloo (vs MPI), one run.

    python -m pycoll bench --backends pycoll,gloo --world-size 2 --min-bytes 8 --max-bytes 64M \\
        --iters 20 --warmup 5 --json out.json [--plot out.png] [--dtype float32] [--op sum]

The launcher (this module) measures the physical reference figures, hosts a TCPStore on a port
the OS picks, spawns ``world_size`` rank processes once (``pycoll.testing.spawn`` running
``pycoll.cli.bench.worker.rank_main``) that each open
one process group per backend and run every (collective, size) with the backends interleaved,
then, when mpirun and mpi4py are installed, runs the same sweep under mpirun
(pycoll.cli.bench.mpi), and merges everything into one set of tables, a JSON file and an
optional plot. ``main(argv)`` is the entry point for ``python -m pycoll bench``. See
docs/bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pycoll.cli.bench import hosts, ref, report
from pycoll.cli.bench.collectives import COLLECTIVES, DTYPES, OPS
from pycoll.cli.bench.load import Busy
from pycoll.testing import netns

# The folder that holds this pycoll package: the rank processes must import the same one.
PACKAGE_ROOT = Path(__file__).resolve().parents[3]

# DESIGN.md: glibc 2.36 memcpy is slow for 4-256 KiB copies at an unlucky 4 KiB offset.
GLIBC_FIX = "glibc.cpu.x86_rep_movsb_threshold=4194304"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'8' -> 8, '64K' / '64KiB' / '64KB' -> 65536, '64M' -> 64 MiB (binary, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8, 4K, 64M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def size_sweep(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo*f, lo*f^2, ... up to hi inclusive."""
    if lo < 1 or hi < lo or factor < 2:
        raise ValueError(f"need 1 <= min-bytes <= max-bytes and step factor >= 2, "
                         f"got {lo}, {hi}, {factor}")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=_csv, default=["pycoll", "gloo"],
                   help="torch.distributed backends, in column order ('mpi' = --mpi on)")
    p.add_argument("--world-size", "-n", type=int, default=None,
                   help="ranks (default 2; with --hosts, hosts x ranks per host)")
    p.add_argument("--hosts", metavar="HxR",
                   help="emulated hosts: H network namespaces with R ranks each (e.g. 4x1, 2x2), "
                        "built, joined and removed by the bench (root and `ip netns`)")
    p.add_argument("--link", metavar="RATE", default="none",
                   help="with --hosts: every host's link shaped both ways with tc tbf at RATE "
                        "(100mbit, 1gbit, 10gbit; 'none': unshaped veth)")
    p.add_argument("--collectives", "-c", type=_csv, default=list(COLLECTIVES),
                   help=f"comma-separated subset of: {','.join(COLLECTIVES)} (default: all)")
    p.add_argument("--min-bytes", "-b", type=parse_size, default=8)
    p.add_argument("--max-bytes", "-e", type=parse_size, default=64 << 20)
    p.add_argument("--step-factor", "-f", type=int, default=2, help="size multiplier per step")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per backend and size")
    p.add_argument("--warmup", "-w", type=int, default=5)
    p.add_argument("--timing", choices=("each", "loop"), default="each",
                   help="each: reset the input and time every op alone (default); loop: time "
                        "back-to-back ops per round, as nccl-tests and OSU do (one untimed op checked first)")
    p.add_argument("--rounds", type=int, default=4,
                   help="interleaving: the iterations run in this many A B A B ... rounds")
    p.add_argument("--dtype", "-d", choices=list(DTYPES), default="float32")
    p.add_argument("--op", "-o", choices=OPS, default="sum")
    p.add_argument("--mpi", choices=("auto", "on", "off"), default="auto",
                   help="MPI column via mpirun + mpi4py (auto: when both are installed)")
    p.add_argument("--json", help="write all figures to this file")
    p.add_argument("--plot", help="write busbw-vs-size plots to this PNG (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any one collective may block before it is an error")
    p.add_argument("--deadline", type=float, default=None,
                   help="kill the whole run after this many seconds")
    p.add_argument("--ref-seconds", type=float, default=0.5,
                   help="seconds per reference figure (TCP, memcpy); 0 skips them")
    p.add_argument("--glibc-tunables", action="store_true",
                   help=f"set GLIBC_TUNABLES={GLIBC_FIX} for the rank processes (announced)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="run beside N busy processes (plain Python loops), as a user's machine is "
                        "never idle; the header states the load")
    return p


def _on_default_path(folder: Path) -> bool:
    """True when a fresh interpreter finds packages in ``folder`` without help (site-packages).
    Such a folder stays off PYTHONPATH: there it would come before the standard library."""
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    return any(Path(d).resolve() == folder for d in dirs if os.path.isdir(d))


def _rank_env(args) -> tuple[dict, list[str]]:
    """Environment of the rank processes, and the notes that announce every change we made."""
    env, notes = dict(os.environ), []
    if not _on_default_path(PACKAGE_ROOT):  # a checkout, not an installed wheel
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + _csv(
            env.get("PYTHONPATH", "").replace(os.pathsep, ",")))
    if "OMP_NUM_THREADS" not in env:  # as torchrun does for several ranks per host
        env["OMP_NUM_THREADS"] = "1"
        notes.append("OMP_NUM_THREADS=1 set for the rank processes (as torchrun does)")
    if args.glibc_tunables:
        env["GLIBC_TUNABLES"] = GLIBC_FIX
        notes.append(f"GLIBC_TUNABLES={GLIBC_FIX} set for the rank processes "
                     "(memcpy alignment workaround, DESIGN.md)")
    elif "GLIBC_TUNABLES" in env:
        notes.append(f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']} inherited from the environment")
    return env, notes


def _wait_all(procs: list, deadline: float | None, what: str) -> None:
    """Wait for every process; the first failure or the deadline kills the rest."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                raise RuntimeError(f"{what}: rank {bad[0][0]} exited with code {bad[0][1]}")
            if all(c == 0 for c in codes):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"{what}: deadline passed")
            time.sleep(0.05)
    finally:
        for p in procs:  # only our own children, by handle
            if p.poll() is None:
                p.kill()
                p.wait()


def run_torch_ranks(cfg: dict, world: int, env: dict, deadline) -> list[dict]:
    """Every rank's records, from fresh rank processes (``pycoll.testing.spawn``)."""
    from pycoll.cli.bench.worker import rank_main
    from pycoll.testing import spawn

    left = deadline - time.monotonic() if deadline is not None else 7 * 24 * 3600.0
    return spawn.run(rank_main, world, cfg, timeout=max(left, 1.0), env=env,
                     store_timeout=cfg["timeout"] * 4)


def mpi_command(world: int) -> tuple[list[str] | None, str | None]:
    """(mpirun prefix, None) when MPI can run, else (None, why not)."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        return None, "mpirun not found (apt-get install -y openmpi-bin libopenmpi-dev)"
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py not installed (pip install mpi4py)"
    ver = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    cmd = [mpirun, "-n", str(world)]
    if "Open MPI" in ver.stdout + ver.stderr or "OpenRTE" in ver.stdout + ver.stderr:
        # no core binding: the torch ranks are not bound either, so both run alike
        cmd += ["--oversubscribe", "--bind-to", "none"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd, None


def run_mpi(cmd: list[str], cfg: dict, world: int, tmp: str, env: dict, deadline):
    """(rank documents, None) or ([], why the MPI column is empty)."""
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    proc = subprocess.Popen(cmd + [sys.executable, "-m", "pycoll.cli.bench.mpi", "--config",
                                   cfg_path, "--out-dir", tmp], env=env)
    try:
        _wait_all([proc], deadline, "mpirun")
    except RuntimeError as e:
        return [], f"{e} (see its messages above)"
    return [json.load(open(os.path.join(tmp, f"mpi{r}.json"))) for r in range(world)], None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    layout = None
    if args.hosts:
        try:
            layout = hosts.parse_hosts(args.hosts)
            link_rate = None if args.link == "none" else args.link
            link_bps = netns.rate_bytes_per_s(link_rate) if link_rate else 0.0
        except ValueError as e:
            p.error(str(e))
        if args.world_size not in (None, layout[0] * layout[1]):
            p.error(f"--world-size {args.world_size} but --hosts {args.hosts} places "
                    f"{layout[0] * layout[1]} ranks")
        args.world_size = layout[0] * layout[1]
        why = netns.unavailable()
        if why:
            print(f"bench: --hosts: {why}", file=sys.stderr)
            return 2
    elif args.link != "none":
        p.error("--link shapes the links of --hosts: give --hosts too")
    if args.world_size is None:
        args.world_size = 2
    bad = [c for c in args.collectives if c not in COLLECTIVES]
    if bad:
        p.error(f"unknown collective(s) {bad}; choose from {','.join(COLLECTIVES)}")
    if args.world_size < 1 or args.iters < 1 or args.warmup < 0 or args.load < 0:
        p.error("need --world-size >= 1, --iters >= 1, --warmup >= 0, --load >= 0")
    try:
        sizes = size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
    except ValueError as e:
        p.error(str(e))
    if args.plot:
        report.require_matplotlib()  # fail now, not after a long sweep
    meta_notes: list[str] = []
    collectives = list(args.collectives)
    if args.world_size < 2 and "sendrecv" in collectives:
        collectives.remove("sendrecv")
        meta_notes.append("sendrecv needs world size >= 2: skipped")
    torch_backends = [b for b in args.backends if b != "mpi"]
    mpi_mode = "on" if "mpi" in args.backends and args.mpi != "off" else args.mpi
    deadline = time.monotonic() + args.deadline if args.deadline else None
    env, env_notes = _rank_env(args)
    meta_notes += env_notes
    if layout and mpi_mode != "off":
        mpi_mode, meta_notes = "off", meta_notes + ["MPI column omitted: not run on emulated hosts"]
    mpi_cmd, mpi_why = (None, "--mpi off") if mpi_mode == "off" else mpi_command(args.world_size)
    from pycoll.cli.bench.backends import MPI_DTYPES
    if mpi_cmd and DTYPES[args.dtype] not in MPI_DTYPES:
        mpi_cmd, mpi_why = None, f"MPI has no standard {args.dtype} type"
    order = torch_backends + (["mpi"] if mpi_cmd or mpi_mode == "on" else [])
    if mpi_cmd is None and mpi_mode == "auto":
        meta_notes.append(f"MPI column omitted: {mpi_why}")
    cfg = {"collectives": collectives, "sizes": sizes, "dtype": args.dtype, "op": args.op,
           "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
           "timing": args.timing, "timeout": args.timeout, "progress": not args.no_progress,
           "torch_backends": torch_backends}

    reference = ref.measure(args.ref_seconds, args.world_size)  # before the ranks: nothing competes
    docs = []
    emulated = netns.EmulatedHosts(layout[0], link_rate) if layout else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="pycoll-bench-") as tmp, emulated as made, \
            Busy(args.load) as busy:
        if layout:
            cfg["hosts"] = hosts.placement(made.names, made.addrs, layout[1])
            meta_notes.append(f"hosts {args.hosts}: {made.describe()}; every socket of the ranks "
                              "but the Store's runs over them")
        if torch_backends:
            try:
                docs += run_torch_ranks(cfg, args.world_size, env, deadline)
            except RuntimeError as e:  # (spawn.RankFailed: with the failing rank's traceback)
                print(f"bench: {e}; no results", file=sys.stderr)
                return 2
        mpi_docs, mpi_err = [], mpi_why
        if mpi_cmd:
            meta_notes.append("MPI ran after the torch backends (separate processes, not "
                              "interleaved with them)")
            mpi_docs, mpi_err = run_mpi(mpi_cmd, cfg, args.world_size, tmp, env, deadline)
        docs += mpi_docs
    result = report.merge(docs, args.world_size, order, collectives)
    if layout and link_bps:
        for name, entry in result["collectives"].items():
            for row in entry["rows"]:
                row["link_bound_us"] = hosts.bound_us(name, row["size"], *layout, link_bps)
    if "mpi" in order and not mpi_docs:
        result["notes"]["mpi"] = mpi_err
    result["meta"] = {
        "world_size": args.world_size, "dtype": args.dtype, "op": args.op, "iters": args.iters,
        "warmup": args.warmup, "rounds": min(args.rounds, args.iters), "sizes": sizes,
        "timing": args.timing, "backends": order, "argv": argv, "notes": meta_notes,
        "load": args.load, "load_text": busy.describe(),
        "hosts": list(layout) if layout else None, "link": args.link if layout else None,
        "link_Bps": link_bps if layout else None,
        "python": platform.python_version(),
        "torch": __import__("torch").__version__, "host": platform.node(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if reference:   # the copy rate drifts with the machine's phases; a bound takes its best
        after = ref.memcpy_per_rank(args.ref_seconds, args.world_size) / 1e9
        reference["memcpy_per_rank_before_after_GBps"] = [reference["memcpy_per_rank_GBps"], after]
        reference["memcpy_per_rank_GBps"] = best = max(reference["memcpy_per_rank_GBps"], after)
        reference["all_reduce_shm_bound_busbw_GBps"] = ref.all_reduce_bound(best, args.world_size)
    result["reference"] = reference
    print(report.format_header(result, order))
    print(report.format_tables(result, order))
    wrong = sum(r["wrong"] for e in result["collectives"].values() for row in e["rows"]
                for r in row["results"].values() if r)
    print(f"\n# #wrong total: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        report.plot(result, order, args.plot)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
