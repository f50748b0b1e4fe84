"""Worlds of connected transports for the conformance kit (``pycoll.testing.conformance``).

A *maker* ``maker(world)`` is a context manager that yields a ``World`` of connected
transports (one per rank, rank order) and on exit closes them and frees all it built
(stores, sockets, segments). Makers for every transport are here: memory, memory in
lockstep, TCP on loopback built by ``build_mesh`` as pycoll builds it (also with polling),
and the shared-memory mailbox transport; ``connect`` builds one rank's transport inside a
process. The frame and thread helpers the checks share sit beside them, with ``no_leaks``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from pycoll.errors import CommError
from pycoll.testing.mailbox_transport import ShmTransport
from pycoll.testing.memory import MemoryHub
from pycoll.testing.ranks import memfd_maps
from pycoll.transport.base import InFrame, OutFrame, Transport
from pycoll.transport.tcp.mesh import build_mesh
from pycoll.transport.tcp.transport import TcpTransport
from pycoll.wire import DATA, Header, Signature

SIG = Signature("all_reduce", 7, "uint8", 0, "sum")
PROMPT = 2.0      # seconds within which a failure must reach a peer (2 busy cores: generous)
MARGIN = 1.5      # seconds a timeout may come after its deadline
SIZES = [0, 1, 7, 4099, None, 0, 3]   # None: the world's ``large``
@dataclass
class World:
    transports: list[Transport]
    large: int                    # a frame larger than one segment / socket buffer / mailbox
    blocking_send: int | None     # bytes a send cannot complete without a reader (None: buffered)
    extra: list = field(default_factory=list)


# -- frames and threads ------------------------------------------------------------------

def data(src: int, dst: int, i: int, n: int) -> bytes:
    return random.Random(f"{src}>{dst}#{i}").randbytes(n)


def out_frame(peer: int, step: int, payload: bytes) -> OutFrame:
    return OutFrame(peer, Header(DATA, SIG, step, 0, len(payload)).encode(), memoryview(payload))


def in_frame(peer: int, step: int, nbytes: int, on_done=None) -> tuple[InFrame, bytearray]:
    dest = bytearray(nbytes)
    return InFrame(peer, Header(DATA, SIG, step, 0, nbytes), memoryview(dest), on_done), dest


def run_threads(fns, timeout: float = 60.0) -> list:
    """Run ``fns[r]()`` in one thread each; a result or the exception raised, by rank."""
    results: list = [None] * len(fns)

    def main(r):
        try:
            results[r] = fns[r]()
        except BaseException as exc:  # noqa: BLE001 - the error is the result
            results[r] = exc

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(len(fns))]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} still running after {timeout} s: a hang"
    return results


def ok(results) -> list:
    errs = [r for r in results if isinstance(r, BaseException)]
    if errs:
        raise errs[0]
    return results


def timed(fn):
    """``fn()`` -> (what it raised, or None, seconds it took)."""
    t0 = time.monotonic()
    try:
        fn()
    except CommError as exc:
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


@contextlib.contextmanager
def no_leaks():
    """Fail if the block leaves threads, descriptors or arena mappings behind."""
    def state():
        gc.collect()
        maps = len(memfd_maps("pycoll-arena"))
        fds = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass    # the descriptor listdir itself used
        return {t.ident for t in threading.enumerate()}, fds, maps

    def left(before, now):
        """What the block added and still holds (things that were there before may go:
        an earlier test's idle threads end on their own)."""
        return now[0] - before[0], now[1] - before[1], max(0, now[2] - before[2])

    before = state()
    yield
    end = time.monotonic() + 5   # threads of a finished check may take a moment to exit
    while any(left(before, state())) and time.monotonic() < end:
        time.sleep(0.05)
    threads, fds, maps = left(before, state())
    assert not (threads or fds or maps), f"left behind: threads {threads}, fds {fds}, arena mappings {maps}"


# -- makers ------------------------------------------------------------------------------

@contextlib.contextmanager
def memory_world(world: int, lockstep: bool = False):
    hub = MemoryHub(world, lockstep=lockstep)
    ts = hub.transports()
    try:
        yield World(ts, large=70_001, blocking_send=1 if lockstep else None)
    finally:
        for t in ts:
            t.close()


def lockstep_world(world: int):
    return memory_world(world, lockstep=True)


def connect(kind: str, store, rank: int, world: int, mailbox: int = 4096) -> Transport:
    """Build rank ``rank``'s transport of kind "tcp" or "shm" the way pycoll does, through
    ``store`` (every rank calls this at once)."""
    if kind == "tcp":
        (socks,) = build_mesh(store, rank, world, 30.0, channels=1)
        return TcpTransport(rank, world, socks)
    return ShmTransport.connect(store, "kit", rank, world, list(range(world)), 30.0, mailbox_bytes=mailbox)


@contextlib.contextmanager
def _process_world(kind: str, world: int, mailbox: int = 4096, spin: float = 0.0):
    # The ranks are threads of this process, so they share one in-process c10d store (a
    # TCPStore costs sockets and, one time in seven here, a 5 s stall in its connect); the
    # transports' own sockets and segments are real. Peer death uses real TCPStores.
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    ts = ok(run_threads([lambda r=r: connect(kind, store, r, world, mailbox) for r in range(world)]))
    if spin:
        for t in ts:
            t.spin = spin
    large = 8 * 2**20 + 3 if kind == "tcp" else 3 * ts[0].mailbox + 5
    blocking = 64 * 2**20 if kind == "tcp" else 4 * ts[0].mailbox
    try:
        yield World(ts, large=large, blocking_send=blocking)
    finally:
        for t in ts:
            t.close()


def tcp_world(world: int):
    return _process_world("tcp", world)


def tcp_spinning_world(world: int):
    """TCP with the polling before a step blocks that groups with cores to spare use."""
    return _process_world("tcp", world, spin=0.001)


def shm_world(world: int, mailbox: int = 4096):
    return _process_world("shm", world, mailbox)

