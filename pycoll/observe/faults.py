"""Fault injection for tests, demos and teaching: ``PYCOLL_FAULT`` (see docs/faults.md).

A fault plan is a list of specs separated by ``;``, each a list of ``key=value`` fields
separated by ``:``::

    PYCOLL_FAULT="rank=1:delay=0.2"                       # rank 1 starts every collective 0.2 s late
    PYCOLL_FAULT="rank=0:slow_link=2:bw=10e6"             # rank 0's sends to rank 2 run at 10 MB/s
    PYCOLL_FAULT="rank=2:op=all_reduce:seq=3:kill_at_step=5"   # SIGKILL at step 5 of that op
    PYCOLL_FAULT="rank=1:drop_at_seq=4"                   # drop every connection at op seq 4

One ``Injector`` per rank, an observer of its group (``core.observer``), holds its faults
and where the current operation is (op, seq, step). A *step* is one unit of an operation on
whatever path it takes: one ``exchange`` of a TCP schedule (the ``transport`` hook wraps
every TCP transport in a ``FaultyTransport``, the host leaders' too) or one barrier of a
shared-memory algorithm (``barrier_begins``); a hierarchical operation counts both, in
order. Ranks without a spec get no injector, so an unset ``PYCOLL_FAULT`` costs nothing.
What each fault does on each path: docs/faults.md.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Sequence

from pycoll import settings
from pycoll.core.observer import Observer
from pycoll.shm.rounds import words_nbytes
from pycoll.transport.base import InFrame, OutFrame, Transport
from pycoll.transport.frames import encoded_header

ENV = "PYCOLL_FAULT"
CORRUPT_KINDS = ("garbage", "huge", "truncate")
HUGE = 1 << 40  # the payload size a "huge" header claims: 1 TiB


@dataclass(frozen=True)
class Fault:
    rank: int | None = None          # None: every rank
    op: str | None = None            # only operations of this name (all_reduce, broadcast, ...)
    seq: int | None = None           # only the operation with this sequence number
    delay: float = 0.0               # sleep before each matching operation
    slow_link: int | None = None     # throttle sends to this peer (-1: every peer) ...
    bw: float = 0.0                  # ... to this many bytes per second
    kill_at_step: int | None = None  # SIGKILL this process at this step (1-based) of a matching op
    stall_at_step: int | None = None  # sleep ``stall`` seconds before this step of a matching op
    stall: float = 0.0
    drop_at_seq: int | None = None   # drop every connection (no goodbye) when op seq N starts
    corrupt_at_step: int | None = None  # damage the first frame sent at this step ...
    corrupt: str = "garbage"            # ... garbage header, "huge" (1 TiB claim) or "truncate"

    def matches(self, op: str, seq: int) -> bool:
        return (self.op is None or self.op == op) and (self.seq is None or self.seq == seq)


_INT = ("rank", "seq", "kill_at_step", "stall_at_step", "drop_at_seq", "corrupt_at_step")
_FLOAT = ("delay", "bw", "stall")


def parse(text: str) -> list[Fault]:
    """Parse a ``PYCOLL_FAULT`` value; a mistake raises ValueError naming the bad field."""
    faults = []
    for spec in filter(None, (s.strip() for s in text.replace("\n", ";").split(";"))):
        kw: dict = {}
        for item in filter(None, spec.split(":")):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise ValueError(f"{ENV}: {item!r} in {spec!r} is not key=value")
            try:
                if key in ("rank", "slow_link") and value in ("*", "all"):
                    kw[key] = None if key == "rank" else -1
                elif key in _INT or key == "slow_link":
                    kw[key] = int(value)
                elif key in _FLOAT:
                    kw[key] = float(value)
                elif key == "op":
                    kw[key] = value
                elif key == "corrupt":
                    if value not in CORRUPT_KINDS:
                        raise ValueError
                    kw[key] = value
                else:
                    raise KeyError(key)
            except KeyError:
                raise ValueError(f"{ENV}: unknown key {key!r} in {spec!r}; known: "
                                 f"{', '.join(_INT + _FLOAT + ('op', 'slow_link', 'corrupt'))}") from None
            except ValueError:
                raise ValueError(f"{ENV}: bad value {value!r} for {key!r} in {spec!r}") from None
        f = Fault(**kw)
        if (f.slow_link is None) != (f.bw <= 0):
            raise ValueError(f"{ENV}: slow_link and bw (bytes/s > 0) go together in {spec!r}")
        if min(f.delay, f.stall) < 0:
            raise ValueError(f"{ENV}: negative delay in {spec!r}")
        faults.append(f)
    return faults


def injector(rank: int, env: str | None = None) -> "Injector | None":
    """This rank's faults from ``PYCOLL_FAULT`` (or ``env``), or None when it has none."""
    text = settings.get(ENV) if env is None else env
    mine = [f for f in parse(text) if f.rank in (None, rank)] if text else []
    return Injector(rank, mine) if mine else None


def wrap(transport: Transport, inj: "Injector | None") -> Transport:
    """``transport`` with ``inj``'s step faults, or itself when there are none."""
    return FaultyTransport(transport, inj) if inj is not None else transport


class Injector(Observer):
    """One rank's faults and the position of its current operation."""

    def __init__(self, rank: int, faults: Sequence[Fault]) -> None:
        self.rank, self.faults = rank, list(faults)
        self.op, self.seq, self.steps = "", -1, 0
        self.sever = None   # callable(reason): drop every connection (the group's, once started)

    def started(self, comm) -> None:
        self.sever = comm.sever

    def transport(self, t: Transport) -> Transport:
        return FaultyTransport(t, self)

    def _active(self):
        return [f for f in self.faults if f.matches(self.op, self.seq)]

    def before_op(self, op: str, seq: int) -> None:
        self.op, self.seq, self.steps = op, seq, 0
        for f in self._active():
            if f.delay:
                time.sleep(f.delay)
            if f.drop_at_seq == seq and self.sever is not None:
                self.sever(f"fault injection: rank {self.rank} dropped its connections at {op} seq {seq}")

    def _step(self) -> list[Fault]:
        """Count one step; kill or stall here if asked. Returns the faults that apply."""
        self.steps += 1
        active = self._active()
        for f in active:
            if f.kill_at_step == self.steps:
                os.kill(os.getpid(), signal.SIGKILL)
            if f.stall_at_step == self.steps:
                time.sleep(f.stall)
        return active

    def exchange(self, outs: list[OutFrame]) -> tuple[list[OutFrame], bool]:
        """A TCP step: the frames to send (one damaged, perhaps), and whether to cut it short."""
        truncate = False
        for f in self._step():
            if f.corrupt_at_step == self.steps and outs:
                outs[0], truncate = _corrupt(outs[0], f.corrupt), f.corrupt == "truncate"
            if f.slow_link is not None:
                nbytes = sum(len(o.header) + len(o.payload) for o in outs if f.slow_link in (-1, o.peer))
                if nbytes:
                    time.sleep(nbytes / f.bw)
        return outs, truncate

    def barrier_begins(self, arena) -> None:
        """A shared-memory step (called by the arena before each barrier).

        Shared memory has no frames: a slow link delays the operation's first barrier by
        (the operation's bytes) / bw, once; a corruption stops this rank with the reason
        its peers report (docs/faults.md).
        """
        for f in self._step():
            if f.slow_link is not None and self.steps == 1:
                nbytes = words_nbytes(arena.published)
                if nbytes:
                    time.sleep(nbytes / f.bw)
            if f.corrupt_at_step == self.steps:
                # Nothing in shared memory is checked per step (it is one trust domain): the
                # damaged rank is made to stop, and to say why, as a peer's garbage frame would.
                arena.abort(f"rank {arena.ranks[arena.me]}'s control words are damaged (fault "
                            f"injection: corrupt={f.corrupt} at step {self.steps} of {self.op} seq {self.seq})")


class FaultyTransport(Transport):
    """Delegates to ``inner``; injects the injector's step faults on the way."""

    def __init__(self, inner: Transport, inj: Injector) -> None:
        self.inner, self.inj = inner, inj
        self.rank, self.world = inner.rank, inner.world
        self.name = f"{inner.name}+faults"

    def __getattr__(self, name):  # anything else a transport offers (conns, subset, ...)
        return getattr(self.inner, name)

    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        outs, truncate = self.inj.exchange(list(outs))
        if truncate:
            # Half of the first frame goes out, then the connections drop.
            self.inner.exchange(outs[:1], [], deadline, what)
            self.inner.sever(f"fault injection: rank {self.rank} truncated a frame in {what}")
        self.inner.exchange(outs, ins, deadline, what)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def sever(self, reason: str) -> None:
        self.inner.sever(reason)

    def close(self) -> None:
        self.inner.close()


def _corrupt(frame: OutFrame, kind: str) -> OutFrame:
    hdr = bytes(frame.header)
    if kind == "garbage":
        return OutFrame(frame.peer, os.urandom(len(hdr)), frame.payload)
    if kind == "truncate":
        cut = (len(hdr) + len(frame.payload)) // 2
        whole = hdr + bytes(frame.payload)
        return OutFrame(frame.peer, whole[:cut], memoryview(b""))
    h = encoded_header(hdr)
    return OutFrame(frame.peer, replace(h, nbytes=HUGE).encode(), frame.payload)
