"""The transport conformance kit: what every pycoll transport must do, written once.

trio's ``check_two_way_stream(maker)`` is the model: each check is a function of a *maker*,
``maker(world)``, a context manager that yields a ``World`` of connected transports (one per
rank, rank order) and on exit closes them and frees all it built (stores, sockets,
segments). Each rank is driven by a thread of its own. Makers for every transport are at the
bottom (memory, memory in lockstep, TCP on loopback built by ``build_mesh``, shared memory);
a new transport adds a maker and passes every check. ``check_peer_death`` needs real
processes: it runs on tests/harness.py's pooled ranks and builds the transport there
(``connect``).

The checks: ordering (frames of a pair arrive in order, across exchanges grouped
differently on the two sides, sizes 0, 1, odd and larger than the transport's segment; both
directions at once; ``on_done`` before the next frame), deadlines (a receive whose peer never
sends, and a send nobody reads, raise CommTimeoutError naming the peer within the deadline
plus a margin), failure (after a failed exchange the transport refuses further ones), abort
(the reason reaches a peer's pending and next exchange, and a rank not waiting for the
aborter; abort from another thread ends the rank's own exchange; the first reason wins),
sever (a crash, to peers: PeerClosedError naming the rank), close (a peer waiting gets
PeerClosedError naming the rank; close is idempotent; afterwards exchange raises CommError
saying "closed"), no leaks (``no_leaks``: threads, descriptors, arena mappings) and peer death (SIGKILL: PeerClosedError naming the rank, quickly, also on a
rank waiting for someone else).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from pycoll.errors import CommError, CommTimeoutError, PeerClosedError
from pycoll.transport.base import InFrame, OutFrame, Transport
from pycoll.transport.memory import MemoryHub
from pycoll.transport.shm.transport import ShmTransport
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


# -- ordering ----------------------------------------------------------------------------

def sizes(world: World) -> list[int]:
    return [world.large if n is None else n for n in SIZES]


def check_ordering_one_way(maker) -> None:
    """Rank 0 sends every size to rank 1 in one grouping, rank 1 receives in another."""
    with maker(2) as w:
        ns = sizes(w)
        t0, t1 = w.transports
        send_groups, recv_groups = [[0, 1, 2], [3], [4], [5, 6]], [[0], [1, 2, 3], [4, 5], [6]]
        order: list[int] = []

        def sender():
            for g in send_groups:
                t0.exchange([out_frame(1, i, data(0, 1, i, ns[i])) for i in g], [],
                            time.monotonic() + 30, "ordering")

        def receiver():
            for g in recv_groups:
                got = []
                for i in g:
                    def done(i=i):
                        order.append(i)
                        assert bytes(got[g.index(i)][1]) == data(0, 1, i, ns[i]), f"frame {i} incomplete"
                    got.append(in_frame(0, i, ns[i], done))
                t1.exchange([], [f for f, _ in got], time.monotonic() + 30, "ordering")
                for i, (_, dest) in zip(g, got):
                    assert bytes(dest) == data(0, 1, i, ns[i]), f"frame {i} corrupted"

        ok(run_threads([sender, receiver]))
        assert order == list(range(len(ns))), order


def check_ordering_all_pairs(maker, world: int = 3) -> None:
    """Every rank sends every size to every other rank and receives from all, several frames
    per exchange, both directions at once (large frames too: no deadlock on full buffers)."""
    groups = [[0, 1, 2], [3], [4], [5, 6]]
    with maker(world) as w:
        ns = sizes(w)

        def rank(r):
            t = w.transports[r]
            peers = [p for p in range(world) if p != r]
            for g in groups:
                outs = [out_frame(p, i, data(r, p, i, ns[i])) for p in peers for i in g]
                ins = [(p, i, *in_frame(p, i, ns[i])) for p in peers for i in g]
                t.exchange(outs, [f for _, _, f, _ in ins], time.monotonic() + 30, "ordering")
                for p, i, _, dest in ins:
                    assert bytes(dest) == data(p, r, i, ns[i]), f"rank {r}: frame {i} from {p} corrupted"

        ok(run_threads([lambda r=r: rank(r) for r in range(world)]))


# -- deadlines and failure ---------------------------------------------------------------

def check_deadline(maker) -> None:
    """A receive whose peer never sends, and a send that nobody reads, time out naming it."""
    with maker(2) as w:
        t0 = w.transports[0]
        f, _ = in_frame(1, 0, 8)
        exc, took = timed(lambda: t0.exchange([], [f], time.monotonic() + 0.3, "deadline"))
        assert isinstance(exc, CommTimeoutError), exc
        assert exc.peer == 1 and "rank 1" in str(exc), exc
        assert 0.3 <= took < 0.3 + MARGIN, took
        # After a failure the transport is unusable (as Gloo's context): it says so at once.
        exc, took = timed(lambda: t0.exchange([], [f], time.monotonic() + 10, "after"))
        assert isinstance(exc, CommError) and took < PROMPT, (exc, took)
    if w.blocking_send is None:
        return
    with maker(2) as w:
        t0 = w.transports[0]
        payload = bytes(w.blocking_send)
        exc, took = timed(lambda: t0.exchange([out_frame(1, 0, payload)], [], time.monotonic() + 0.3,
                                              "deadline"))
        assert isinstance(exc, CommTimeoutError), exc
        assert exc.peer == 1 and "rank 1" in str(exc), exc
        assert 0.3 <= took < 0.3 + MARGIN, took


# -- abort, sever, close -----------------------------------------------------------------

def wait_for(t: Transport, peer: int, what: str, timeout: float = 20.0):
    f, _ = in_frame(peer, 0, 8)
    return timed(lambda: t.exchange([], [f], time.monotonic() + timeout, what))


def check_abort(maker) -> None:
    reason = "conformance: rank 0 stops here"
    # A pending exchange: rank 1 waits for rank 0, rank 2 waits for rank 1 (not the aborter).
    with maker(3) as w:
        t0, t1, t2 = w.transports

        def aborter():
            time.sleep(0.3)
            t0.abort(reason)
            t0.abort("a second reason, which nobody reports")
            return timed(lambda: t0.exchange([out_frame(1, 0, b"x")], [], time.monotonic() + 10, "own"))

        res = ok(run_threads([aborter, lambda: wait_for(t1, 0, "pending"), lambda: wait_for(t2, 1, "bystander")]))
        own_exc, own_took = res[0]
        assert isinstance(own_exc, CommError) and own_took < PROMPT, res[0]
        for r in (1, 2):
            exc, took = res[r]
            assert isinstance(exc, CommError) and reason in str(exc), (r, exc)
            assert "second reason" not in str(exc), exc
            assert took < 0.3 + PROMPT, (r, took)
        assert res[1][0].peer == 0, res[1][0]
    # The next exchange after the abort, and abort from another thread of the rank itself.
    with maker(2) as w:
        t0, t1 = w.transports
        t0.abort(reason)
        exc, took = wait_for(t1, 0, "next")
        assert isinstance(exc, CommError) and reason in str(exc) and took < PROMPT, (exc, took)
    with maker(2) as w:
        t0 = w.transports[0]
        threading.Timer(0.3, t0.abort, args=("stopped by a watchdog thread",)).start()
        exc, took = wait_for(t0, 1, "own")
        assert isinstance(exc, CommError) and took < 0.3 + PROMPT, (exc, took)


def check_sever(maker) -> None:
    """``sever`` is what a crash looks like to peers: PeerClosedError naming the rank."""
    with maker(2) as w:
        t0, t1 = w.transports

        def cut():
            time.sleep(0.3)
            t0.sever("fault injection")
            return timed(lambda: t0.exchange([out_frame(1, 0, b"x")], [], time.monotonic() + 10, "own"))

        res = ok(run_threads([cut, lambda: wait_for(t1, 0, "sever")]))
        exc, took = res[1]
        assert isinstance(exc, PeerClosedError) and "rank 0" in str(exc) and exc.peer == 0, exc
        assert took < 0.3 + PROMPT, took
        exc, took = res[0]
        assert isinstance(exc, CommError) and took < PROMPT, (exc, took)


def check_close(maker) -> None:
    """A peer waiting for a rank that closes hears of it at once; close is idempotent."""
    with maker(2) as w:
        t0, t1 = w.transports

        def closer():
            time.sleep(0.3)
            t0.close()
            t0.close()

        res = ok(run_threads([closer, lambda: wait_for(t1, 0, "close")]))
        exc, took = res[1]
        assert isinstance(exc, PeerClosedError) and "rank 0" in str(exc) and exc.peer == 0, exc
        assert took < 0.3 + PROMPT, took


def check_exchange_after_close(maker) -> None:
    """After close, exchange raises a CommError that says so (not whatever the freed
    resources happen to raise)."""
    with maker(2) as w:
        t0 = w.transports[0]
        t0.close()
        exc, took = timed(lambda: t0.exchange([out_frame(1, 0, b"x")], [], time.monotonic() + 10, "closed"))
        assert isinstance(exc, CommError) and "closed" in str(exc) and took < PROMPT, (exc, took)


@contextlib.contextmanager
def no_leaks():
    """Fail if the block leaves threads, descriptors or arena mappings behind."""
    def state():
        gc.collect()
        with open("/proc/self/maps") as f:
            maps = sum("pycoll-arena" in line for line in f)
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


# -- peer death (real processes) -------------------------------------------------------

def death_rank(rank: int, world: int, kind: str, victim: int):
    """On a pooled rank: connect, exchange once with everyone, then ``victim`` SIGKILLs
    itself; rank 0 waits for the victim, every other survivor for a live rank (which never
    sends). Returns (seconds from the kill to the error, error class, text, peer)."""
    from tests.harness import rank_store

    store = rank_store()
    t = connect(kind, store, rank, world)
    peers = [p for p in range(world) if p != rank]
    ins = [in_frame(p, 0, 3)[0] for p in peers]
    t.exchange([out_frame(p, 0, b"abc") for p in peers], ins, time.monotonic() + 30, "warm-up")
    store.add("ready", 1)
    while store.add("ready", 0) < world:
        time.sleep(0.005)
    if rank == victim:
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    waits_for = victim if rank == 0 else next(p for p in peers if p != victim)
    exc, _ = wait_for(t, waits_for, "death", timeout=20)
    delay = time.time() - float(store.get("killed_at"))
    # Close only once every survivor has seen the death: a goodbye would race it.
    store.add("seen", 1)
    while store.add("seen", 0) < world - 1:
        time.sleep(0.005)
    t.close()
    return delay, type(exc).__name__, str(exc), getattr(exc, "peer", None)


def check_peer_death(kind: str, world: int = 3, victim: int = 1) -> None:
    from tests.harness import run_ranks

    res = run_ranks(death_rank, world, kind, victim, timeout=90, may_die=(victim,))
    assert res[victim] == "died", res
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        delay, cls, text, peer = r
        assert cls == "PeerClosedError" and f"rank {victim}" in text and peer == victim, (rank, r)
        limit = PROMPT if rank == 0 else PROMPT + 1.0   # a bystander may allow a grace period
        assert delay < limit, f"rank {rank} learned of the death after {delay:.2f} s: {text}"
        print(f"\n  {kind}: rank {rank} raised {delay * 1000:.0f} ms after the kill: {text}")
