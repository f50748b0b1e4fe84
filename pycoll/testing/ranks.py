"""The rank launcher of tests and tools: a reusable pool of rank processes.

Starting a Python process that imports torch costs seconds on this machine, so rank
processes are forked once from a forkserver with torch preloaded and reused by every
test in the session. ``run_ranks(fn, world_size, ...)`` runs ``fn(rank, world_size,
*args)`` on the first ``world_size`` workers, each with a fresh c10d TCPStore (bound
to port 0 by this parent process, so no fixed ports) and, if ``backend`` is given, an
initialised default process group that is destroyed afterwards; a destroyed group must
leave no pycoll shared memory mapped or open in the rank (``pycoll_memory``), or the run fails.

The first failure or a timeout kills every worker (as torch's MultiProcessTestCase
does) and the pool is rebuilt lazily for the next test, so a hung collective can
never leak into the next test case.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import time
import traceback
from datetime import timedelta

from pycoll.testing.spawn import environ

# The launcher's channel to its ranks, not a setting (the leading underscore keeps it out of
# the PYCOLL_* settings table): the address of the run's Store.
STORE_ENV = "_PYCOLL_RANK_STORE"


class RankFailure(AssertionError):
    """One or more ranks raised or timed out; the message carries their tracebacks."""


def _worker_main(conn) -> None:
    # The worker ignores SIGINT so a Ctrl-C in pytest tears down via the parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch.distributed as dist

    from pycoll import torch_compat

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        fn, rank, world, args, backend, port, env, timeout_s = msg
        with environ({**env, STORE_ENV: f"127.0.0.1:{port}"}):
            try:
                if backend is not None:
                    try:
                        import pycoll  # noqa: F401  registers the backend
                    except ImportError:
                        pass
                    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                                          timeout=timedelta(seconds=timeout_s))
                    dist.init_process_group(backend, rank=rank, world_size=world, store=store,
                                            timeout=timedelta(seconds=timeout_s))
                try:
                    result = fn(rank, world, *args)
                finally:
                    if backend is not None and dist.is_initialized():
                        dist.destroy_process_group()
                    # (a failed init leaves torch's group count advanced: a hang at the next init)
                    torch_compat.reset_group_count()
                    # Free the test's objects here, on the main thread: a garbage collection that
                    # a backend's own thread runs later could free a gloo group there, whose
                    # destructor then joins the thread it runs on (std::terminate, EDEADLK).
                    gc.collect()
                left = pycoll_memory() if backend is not None else []
                end = time.monotonic() + 2.0
                while left and time.monotonic() < end:
                    # (a pycoll thread, e.g. a future callback's, may still be dropping its last
                    # reference to a buffer as the group goes: a moment, not a leak)
                    time.sleep(0.02)
                    gc.collect()
                    left = pycoll_memory()
                if left:   # the group is gone: so must be every piece of shared memory it mapped
                    raise AssertionError(f"rank {rank}: the destroyed group left pycoll's shared memory "
                                         f"mapped or open: {left}")
                conn.send(("ok", result))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                conn.send(("err", traceback.format_exc()))


def memfd_maps(name: str = "pycoll-") -> list[str]:
    """The lines of /proc/self/maps that map a memfd whose name starts with ``name``
    (``pycoll-arena``, ``pycoll-heap``...): one per mapping. The memfd has no name in
    /dev/shm to look for; the kernel shows it here as ``/memfd:pycoll-... (deleted)``."""
    with open("/proc/self/maps") as f:
        return [line for line in f if f"memfd:{name}" in line]


def memfd_fds(name: str = "pycoll-") -> list[str]:
    """This process's descriptors of such memfds, as ``fd N -> /memfd:...``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue   # the descriptor listdir itself used
        if f"memfd:{name}" in target:
            found.append(f"fd {fd} -> {target}")
    return found


def pycoll_memory() -> list[str]:
    """This process's mappings (each segment once) and descriptors of pycoll's shared memory:
    what a destroyed group must not leave."""
    return sorted({line.split(None, 5)[-1].strip() for line in memfd_maps()}) + memfd_fds()


def forkserver():
    """The multiprocessing context every rank starts from: a forkserver with torch (and pycoll)
    preloaded, so a rank starts in ~0.1 s instead of seconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pycoll", "ddp"])
    return ctx


class _Pool:
    def __init__(self) -> None:
        self._ctx = forkserver()
        self._workers: list[tuple[mp.Process, mpc.Connection]] = []

    def ensure(self, n: int) -> None:
        while len(self._workers) < n:
            parent, child = self._ctx.Pipe()
            p = self._ctx.Process(target=_worker_main, args=(child,), daemon=True)
            p.start()
            child.close()
            self._workers.append((p, parent))

    def kill_all(self) -> None:
        for p, conn in self._workers:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:  # it exited between the check and the kill
                    pass
        for p, conn in self._workers:
            p.join(5)
            conn.close()
        self._workers = []

    def shutdown(self) -> None:
        for p, conn in self._workers:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p, _ in self._workers:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill_all()

    def run(self, fn, world, args, backend, timeout, env, may_die=()):
        import torch.distributed as dist

        self.ensure(world)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        workers = self._workers[:world]
        for rank, (_, conn) in enumerate(workers):
            conn.send((fn, rank, world, args, backend, store.port, dict(env or {}), timeout))
        results: list = [None] * world
        pending = {conn: rank for rank, (_, conn) in enumerate(workers)}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        while pending and not errors:
            left = deadline - time.monotonic()
            if left <= 0:
                errors.append(f"timeout after {timeout}s; ranks still running: {sorted(pending.values())}")
                break
            for conn in mpc.wait(list(pending), timeout=min(left, 1.0)):
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "err", "worker process died"
                if rank in may_die and status == "err" and value == "worker process died":
                    status, value = "ok", "died"
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
            for rank_conn, rank in list(pending.items()):
                proc = workers[rank][0]
                if not proc.is_alive():
                    pending.pop(rank_conn)
                    if rank in may_die:
                        results[rank] = "died"
                    else:
                        errors.append(f"rank {rank} process died (exit code {proc.exitcode})")
        if errors:
            # Give the other ranks a moment to report their own errors: the first error is
            # often a consequence, the root cause sits in another rank.
            grace = time.monotonic() + 1.0
            while pending and time.monotonic() < grace:
                for conn in mpc.wait(list(pending), timeout=0.2):
                    rank = pending.pop(conn)
                    try:
                        status, value = conn.recv()
                        if status == "err":
                            errors.append(f"rank {rank} failed:\n{value}")
                    except EOFError:
                        pass
            self.kill_all()
            raise RankFailure("\n".join(errors))
        if may_die:
            self.kill_all()  # a rank died as the test intended: rebuild the pool next time
        return results


_POOL: _Pool | None = None


def run_ranks(fn, world_size: int, *args, backend: str | None = None, timeout: float = 60,
              env: dict | None = None, may_die: tuple[int, ...] = ()) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` pooled ranks; return results by rank.

    Ranks in ``may_die`` are allowed to die (tests of dead peers kill them on purpose);
    their result is the string "died".
    """
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(shutdown)
    return _POOL.run(fn, world_size, args, backend, timeout, env, tuple(may_die))


def shutdown() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.shutdown()
        _POOL = None


def rank_store():
    """The fresh c10d store of the current run_ranks call (inside a rank)."""
    import torch.distributed as dist

    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False)
