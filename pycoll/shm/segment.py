"""A memory segment shared by the local ranks with nothing ever named: memfd + /proc/<pid>/fd.

Local rank 0 creates an anonymous memfd, publishes ``/proc/<its pid>/fd/<n>`` through the
Store and keeps the descriptor only until every local rank has opened that path and mapped
it (the kernel lets only processes that may ptrace the creator open it: the same user, or
root). From then on the memory lives exactly as long as the mappings, so a ``kill -9`` of
any rank at any moment leaves nothing behind, and the path names the creator's pid, so a
rank whose creator died says so at once. The arena and the registered-buffer heap both map
their segments here (docs/shm.md).
"""

from __future__ import annotations

import mmap
import os
import time

from pycoll import rendezvous
from pycoll.errors import CommTimeoutError, PeerClosedError
from pycoll.shm import futex


def map_segment(store, key: str, local_rank: int, size: int, total: int, deadline: float,
                what: str, name: str) -> tuple[mmap.mmap, int]:
    """Map the ``total``-byte segment ``key`` of ``size`` local ranks; returns it and its
    creator's pid. ``what`` names the caller in errors ("shm init", "empty_shared"), ``name``
    the memfd (``pycoll-<name>`` in /proc/<pid>/fd and /proc/<pid>/maps)."""
    if local_rank == 0:
        fd = os.memfd_create(f"pycoll-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total)
            store.set(f"{key}/name", f"/proc/{os.getpid()}/fd/{fd}")
            store.add(f"{key}/mapped", 1)
            while store.add(f"{key}/mapped", 0) < size:
                rendezvous.check_watch()
                if time.monotonic() > deadline:
                    raise CommTimeoutError(f"{what}: local ranks did not map the shared segment in time ({key})")
                time.sleep(0.001)
        finally:
            os.close(fd)
        return mm, os.getpid()
    path = rendezvous.get(store, f"{key}/name", deadline)
    creator = int(path.split("/")[2])
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        why = "rank 0 died" if not futex.alive(creator) else "rank 0 runs as another user"
        raise PeerClosedError(f"{what}: cannot open local rank 0's segment {path}: {exc.strerror} "
                              f"({why})") from None
    try:
        mm = mmap.mmap(fd, total)
    finally:
        os.close(fd)
    store.add(f"{key}/mapped", 1)
    return mm, creator
