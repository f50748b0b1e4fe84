"""One rank of the torch.distributed side of the benchmark (``rank_main``, started by the
launcher through ``pycoll.testing.spawn``).

The rank joins the launcher's TCPStore, makes a gloo default group (used only to agree on which
backends are healthy, never timed), then one group per backend under test with
``dist.new_group(backend=...)``, runs the shared sweep and returns its per-rank records.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

import torch
import torch.distributed as dist

from pycoll.cli.bench.backends import TorchApi
from pycoll.cli.bench.harness import Progress, run_sweep, sweep_plan


def _agree(flags: list) -> list:
    # Default (gloo) group: not one of the groups under test, so it cannot skew their figures.
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def _open_groups(backends: list[str], timeout: timedelta) -> tuple[dict, dict]:
    """(groups, notes). A backend is used only if it works on every rank."""
    notes: dict[str, str] = {}
    for b in backends:
        if b == "pycoll":
            try:
                importlib.import_module("pycoll")  # importing registers the backend
            except Exception as e:  # noqa: BLE001 - report any import failure, keep going
                notes[b] = f"import pycoll failed: {type(e).__name__}: {e}"
    usable = [b for b, ok in zip(backends, _agree([b not in notes for b in backends])) if ok]
    for b in backends:
        if b not in usable and b not in notes:
            notes[b] = "unavailable on another rank"
    groups = {}
    for b in usable:  # same order on every rank: new_group is collective
        try:
            groups[b] = dist.new_group(backend=b, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            notes[b] = f"new_group(backend={b!r}) failed: {type(e).__name__}: {e}"
    ok = _agree([b in groups for b in usable])
    for b, good in zip(usable, ok):
        if not good:
            groups.pop(b, None)
            notes.setdefault(b, "new_group failed on another rank")
    return groups, notes


def rank_main(rank: int, world: int, port: int, cfg: dict) -> dict:
    """Rank ``rank`` of ``world`` around the launcher's Store on ``port``: its records."""
    timeout = timedelta(seconds=cfg["timeout"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    if cfg.get("hosts"):   # the Store's socket stays on the launcher's loopback, the rest moves
        from pycoll.cli.bench.hosts import enter_rank
        enter_rank(cfg["hosts"], rank)
    # The agreement channel must outlive a backend's timeout, hence the longer deadline.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout * 3)
    groups, notes = _open_groups(cfg["torch_backends"], timeout)
    apis = {b: TorchApi(g, cfg["op"]) for b, g in groups.items()}
    progress = Progress(len(sweep_plan(cfg, world)), ",".join(apis) or "-",
                        enabled=cfg["progress"] and rank == 0)
    records = run_sweep(cfg, rank, world, apis, _agree, progress) if apis else []
    dist.barrier()  # nobody tears down connections a peer still reads from
    dist.destroy_process_group()
    return {"rank": rank, "notes": notes, "backends": list(apis), "records": records}
