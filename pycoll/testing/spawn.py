"""Fresh rank processes around a Store this process hosts: the launcher of the tools and the CLI.

``run(target, world, *args)`` starts ``world`` processes, each calling
``target(rank, world, store_port, *args)``, and returns their values by rank. ``spawn`` (the
default) gives each a clean interpreter, as a user's job has; ``context="forkserver"``
shares one preloaded interpreter. The Store listens on a port the OS picks; ``env`` is set
in the ranks from their start (``OMP_NUM_THREADS`` must be, before torch loads). A rank that
raises fails the run with its traceback (``RankFailed``), and so does one that dies, unless
the caller named it in ``may_die`` (``tools/survive.py`` and ``tools/heal.py`` kill ranks on
purpose); every process is joined, and killed if it lingers, before ``run`` returns. The
tests' launchers are ``ranks`` (a pool of reused ranks) and ``fresh`` (ranks that may die,
for fault tests).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queues
import time
import traceback
from datetime import timedelta


class RankFailed(RuntimeError):
    """A rank raised (its traceback is the message) or did not report in time."""


def _entry(target, rank: int, world: int, port: int, args: tuple, out) -> None:
    try:
        out.put((rank, "ok", target(rank, world, port, *args)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put((rank, "err", traceback.format_exc()))
    # The report is on its way before the interpreter's teardown, whatever that does.
    out.close()
    out.join_thread()


@contextlib.contextmanager
def environ(env: dict | None):
    """``env`` set in os.environ for the block, the earlier values back after it."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(target, world: int, *args, timeout: float = 1800, context: str = "spawn",
        env: dict | None = None, store_timeout: float = 120, daemon: bool = True,
        preload: list[str] | None = None, may_die=()) -> list:
    """Every rank's value of ``target(rank, world, store_port, *args)``, by rank, within
    ``timeout`` seconds for the whole run (a rank that dies fails it at once, unless it is
    one of ``may_die``: a tool that kills ranks on purpose; such a rank's value is None).
    ``daemon=False`` lets ranks have children (DataLoader workers); ``preload`` names modules
    the forkserver imports once."""
    import torch.distributed as dist

    ctx = mp.get_context(context)
    if preload and context == "forkserver":
        ctx.set_forkserver_preload(preload)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=store_timeout))
    out = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, r, world, store.port, args, out), daemon=daemon)
             for r in range(world)]
    with environ(env):
        for proc in procs:
            proc.start()
    results: list = [None] * world
    left = set(range(world))
    deadline = time.monotonic() + timeout
    try:
        while left:
            try:
                rank, status, value = out.get(timeout=0.2)
            except queues.Empty:
                dead = [r for r in left if procs[r].exitcode not in (None, 0)]
                left.difference_update(r for r in dead if r in may_die)
                dead = [r for r in dead if r not in may_die]
                if dead:
                    raise RankFailed(f"rank {dead[0]} of {world} exited with code "
                                     f"{procs[dead[0]].exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    raise RankFailed(f"ranks {sorted(left)} of {world} did not report within "
                                     f"{timeout:g} s") from None
                continue
            if status != "ok":
                raise RankFailed(f"rank {rank} of {world} failed:\n{value}")
            results[rank] = value
            left.discard(rank)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return results
