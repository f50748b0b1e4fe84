"""The transport conformance kit: what every pycoll transport must do, written once.

trio's ``check_two_way_stream(maker)`` is the model: each check is a function of a *maker*,
``maker(world)``, a context manager that yields a ``World`` of connected transports (one per
rank, rank order) and on exit closes them and frees all it built (stores, sockets,
segments). Each rank is driven by a thread of its own. Makers for every transport are in
``pycoll.testing.worlds``; a new transport adds a maker and passes every check.
``check_peer_death`` needs real processes: it runs on ``pycoll.testing.ranks``' pooled ranks
and builds the transport there (``worlds.connect``).

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

import os
import signal
import threading
import time

from pycoll.errors import CommError, CommTimeoutError, PeerClosedError
from pycoll.testing.worlds import (MARGIN, PROMPT, SIZES, World, connect, data, in_frame, ok,
                                   out_frame, run_threads, timed)
from pycoll.transport.base import Transport


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


# -- peer death (real processes) -------------------------------------------------------

def death_rank(rank: int, world: int, kind: str, victim: int):
    """On a pooled rank: connect, exchange once with everyone, then ``victim`` SIGKILLs
    itself; rank 0 waits for the victim, every other survivor for a live rank (which never
    sends). Returns (seconds from the kill to the error, error class, text, peer)."""
    from pycoll.testing.ranks import rank_store

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
    from pycoll.testing.ranks import pycoll_memory
    return delay, type(exc).__name__, str(exc), getattr(exc, "peer", None), pycoll_memory()


def check_peer_death(kind: str, world: int = 3, victim: int = 1) -> None:
    from pycoll.testing.ranks import run_ranks

    res = run_ranks(death_rank, world, kind, victim, timeout=90, may_die=(victim,))
    assert res[victim] == "died", res
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        delay, cls, text, peer, held = r
        assert cls == "PeerClosedError" and f"rank {victim}" in text and peer == victim, (rank, r)
        assert held == [], f"rank {rank}'s closed transport left shared memory: {held}"
        limit = PROMPT if rank == 0 else PROMPT + 1.0   # a bystander may allow a grace period
        assert delay < limit, f"rank {rank} learned of the death after {delay:.2f} s: {text}"
        print(f"\n  {kind}: rank {rank} raised {delay * 1000:.0f} ms after the kill: {text}")
