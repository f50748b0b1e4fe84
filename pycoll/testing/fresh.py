"""Launcher for fault tests: fresh rank processes that may die, with every process reaped.

``ranks.py``'s pool treats a dead rank as a failed test (and rebuilds the pool);
fault tests kill ranks on purpose. ``launch`` forks fresh ranks from the same forkserver
(torch preloaded, so a rank starts in ~0.1 s), gives each a pycoll group over a fresh
store, records when each process died (``died_at``, from its sentinel) and what each
survivor reported, and in every case kills and reaps every process before returning.
Each rank may run in a network namespace (``netns``) with its own listen address.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import traceback
from datetime import timedelta

from pycoll.testing import ranks
from pycoll.testing.netns import enter

BASE: dict = {}   # in a rank: fds/threads measured after the store, before the group


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def pycoll_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pycoll")]


def _child(conn, fn, rank, world, args, env, group_timeout, store_addr, netns) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if netns:
            enter(netns)
        os.environ.update(env)
        import torch.distributed as dist

        import pycoll  # noqa: F401  registers the backend

        host, port = store_addr
        if port == 0:  # rank 0 hosts the store (across namespaces, as torchrun's rank 0 would)
            store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=group_timeout + 30))
            conn.send(("port", store.port))
        else:
            if port < 0:
                port = conn.recv()
            store = dist.TCPStore(host, port, world, is_master=False,
                                  timeout=timedelta(seconds=group_timeout + 30))
        BASE.update(fds=fd_count(), threads=threading.active_count())
        dist.init_process_group("pycoll", rank=rank, world_size=world, store=store,
                                timeout=timedelta(seconds=group_timeout))
        conn.send(("ready", time.time()))
        value = fn(rank, world, *args)
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.send(("ok", value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("err", traceback.format_exc()))


def launch(fn, world: int, *args, env: dict | None = None, group_timeout: float = 30.0,
           timeout: float = 60.0, netns: list[str] | None = None, store_host: str = "127.0.0.1",
           kill_after: tuple[int, float] | None = None) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh ranks; return one dict per rank.

    Each dict has ``status`` ("ok", "err", "dead" or "hung"), ``value`` (fn's result or
    the traceback), ``exitcode``, ``died_at`` (wall time the process ended) and ``ready``
    (wall time its group was up). ``kill_after=(rank, seconds)`` SIGKILLs that rank that
    long after every rank is ready; ``killed_at`` then holds the time of the kill.
    """
    import torch.distributed as dist

    ctx = ranks.forkserver()
    env = {"PYCOLL_TRANSPORT": "tcp", **(env or {})}
    store = None
    if netns:
        addr = [(store_host, 0)] + [(store_host, -1)] * (world - 1)
    else:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        addr = [("127.0.0.1", store.port)] * world
    procs, conns = [], []
    out = [{"status": "hung", "value": None, "exitcode": None, "died_at": None, "ready": None}
           for _ in range(world)]
    try:
        for r in range(world):
            parent, child = ctx.Pipe()
            renv = dict(env)
            if netns:
                renv.update((env or {}).get(f"rank{r}", {}))
            renv = {k: v for k, v in renv.items() if not k.startswith("rank")}
            p = ctx.Process(target=_child, args=(child, fn, r, world, args, renv, group_timeout,
                                                 addr[r], netns[r] if netns else None), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        deadline = time.monotonic() + timeout
        live = {c: r for r, c in enumerate(conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        kill_at = None
        while (live or sentinels) and time.monotonic() < deadline:
            if kill_at is None and kill_after and all(o["ready"] for o in out):
                kill_at = time.monotonic() + kill_after[1]
            wait = min(0.2, max(0.0, deadline - time.monotonic()))
            if kill_at is not None and kill_at > 0:
                wait = min(wait, max(0.0, kill_at - time.monotonic()))
            ready = mpc.wait(list(live) + list(sentinels), timeout=wait)
            if kill_at is not None and kill_at > 0 and time.monotonic() >= kill_at:
                victim = kill_after[0]
                out[victim]["killed_at"] = time.time()
                os.kill(procs[victim].pid, signal.SIGKILL)
                kill_at = -1.0
            for obj in ready:
                if obj in live:
                    r = live[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        del live[obj]
                        continue
                    if msg[0] == "port":
                        for c in conns[1:]:
                            c.send(msg[1])
                    elif msg[0] == "ready":
                        out[r]["ready"] = msg[1]
                    else:
                        out[r]["status"], out[r]["value"] = msg
                        del live[obj]
                elif obj in sentinels:
                    r = sentinels.pop(obj)
                    out[r]["died_at"] = time.time()
        for r, p in enumerate(procs):
            p.join(0.5 if out[r]["status"] != "hung" else 0)
            out[r]["exitcode"] = p.exitcode
            if out[r]["status"] == "hung" and p.exitcode is not None:
                out[r]["status"] = "dead"
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(5)
        for c in conns:
            c.close()
        if store is not None:
            del store
    return out


def explain(out: list[dict]) -> str:
    return "\n".join(f"rank {r}: {o['status']} exit={o['exitcode']}\n{o['value']}" for r, o in enumerate(out))
