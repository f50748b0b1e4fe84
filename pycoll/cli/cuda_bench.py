"""GPU all_reduce benchmark: pycoll's nccl / ipc / staging paths against torch's own NCCL.

    python -m pycoll cuda-bench                          # table on stdout
    python -m pycoll cuda-bench --json out.jsonl --max-bytes 268435456 --timeout 120

Each configuration runs in fresh processes (spawned, so no CUDA state is inherited) that all
use GPU 0 unless there are enough GPUs for one each: NCCL refuses two ranks on one GPU, so on a
one-GPU machine the NCCL rows have world size 1, while ipc and staging run 2 and 4 processes
sharing the GPU. Per size: one checked all_reduce (float32, #wrong counts elements that differ
from the expected sum), one warm-up, then a fixed number of timed iterations (fewer for larger
sizes) between two device synchronisations. busbw = bytes x 2(P-1)/P / time (nccl-tests'
convention; 0 for P = 1, where algbw is the figure to read).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from datetime import timedelta

from pycoll.testing import spawn

SIZES = [8 << (2 * k) for k in range(13)] + [256 << 20]   # 8 B, 32 B, ..., 128 MiB, 256 MiB


def _rank(rank, world, port, backend, path, sizes) -> list | None:
    if path:
        os.environ["PYCOLL_CUDA_PATH"] = path
    import torch
    import torch.distributed as dist
    if backend == "pycoll":
        importlib.import_module("pycoll")  # registers the backend
    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", rank % ngpu if ngpu >= world else 0)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, rank=rank, world_size=world, store=store, timeout=timedelta(seconds=60))
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        t = torch.full((n,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        wrong = int((t != world * (world + 1) / 2).sum().item())
        iters = max(2, min(40, (32 << 20) // max(nbytes, 1)))
        t.fill_(1.0 / world)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        rows.append({"bytes": n * 4, "us": dt * 1e6, "algbw": n * 4 / dt / 1e9,
                     "busbw": n * 4 * 2 * (world - 1) / world / dt / 1e9, "wrong": wrong, "iters": iters})
    dist.barrier()
    dist.destroy_process_group()
    return rows if rank == 0 else None


def run_config(backend: str, path: str | None, world: int, sizes: list[int], timeout: float):
    try:
        return "ok", spawn.run(_rank, world, backend, path, sizes, timeout=timeout, store_timeout=60)[0]
    except spawn.RankFailed as exc:
        return "err", str(exc)


def configs(ngpu: int, nccl_ok: bool) -> list[tuple[str, str, str | None, int]]:
    w = 2 if ngpu >= 2 else 1
    out = []
    if nccl_ok:
        out.append((f"pycoll-nccl P={w}", "pycoll", "nccl", w))
    out.append((f"torch-nccl P={w}", "nccl", None, w))
    for p in (2, 4):
        out.append((f"pycoll-ipc P={p}", "pycoll", "ipc", p))
    for p in (2, 4):
        out.append((f"pycoll-staging P={p}", "pycoll", "staging", p))
    return out


def table(results: dict, sizes: list[int]) -> str:
    names = list(results)
    head = f"{'bytes':>10} " + " ".join(f"{n:>24}" for n in names)
    lines = [head, " " * 11 + " ".join(f"{'us   algbw busbw #wrong':>24}" for _ in names)]
    for i, nbytes in enumerate(sizes):
        cells = []
        for n in names:
            status, rows = results[n]
            if status != "ok":
                cells.append(f"{'-':>24}")
                continue
            r = rows[i]
            cells.append(f"{r['us']:9.1f} {r['algbw']:6.2f} {r['busbw']:5.2f} {r['wrong']:>5}")
        lines.append(f"{nbytes:>10} " + " ".join(cells))
    for n in names:
        if results[n][0] != "ok":
            lines.append(f"{n}: {results[n][1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pycoll cuda-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--timeout", type=float, default=150, help="seconds per configuration")
    ap.add_argument("--json", help="append one JSON line per configuration to this file")
    ap.add_argument("--only", help="comma-separated substrings of configuration names to run")
    args = ap.parse_args(argv)
    import torch

    from pycoll.cuda.facts import nccl_importable

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    sizes = [s for s in SIZES if s <= args.max_bytes]
    results = {}
    for name, backend, path, world in configs(torch.cuda.device_count(), nccl_importable()):
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        t0 = time.monotonic()
        results[name] = run_config(backend, path, world, sizes, args.timeout)
        print(f"# {name}: {results[name][0]} in {time.monotonic() - t0:.1f} s", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"config": name, "status": results[name][0], "rows": results[name][1]}) + "\n")
    print(table(results, sizes))
    bad = sum(r["wrong"] for s, rows in results.values() if s == "ok" for r in rows)
    failed = [n for n, (s, _) in results.items() if s != "ok"]
    print(f"# wrong elements: {bad}; failed configurations: {failed or 'none'}")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
