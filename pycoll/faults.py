"""Fault injection for tests, demos and teaching: ``PYCOLL_FAULT`` (see docs/faults.md).

A fault plan is a list of specs separated by ``;``, each a list of ``key=value`` fields
separated by ``:``::

    PYCOLL_FAULT="rank=1:delay=0.2"                       # rank 1 starts every collective 0.2 s late
    PYCOLL_FAULT="rank=0:slow_link=2:bw=10e6"             # rank 0's sends to rank 2 run at 10 MB/s
    PYCOLL_FAULT="rank=2:op=all_reduce:seq=3:kill_at_step=5"   # SIGKILL at step 5 of that op
    PYCOLL_FAULT="rank=1:drop_at_seq=4"                   # drop every connection at op seq 4

It works by wrapping whatever ``Transport`` the group built (TCP, shared memory, memory)
in a ``FaultyTransport`` that delegates ``exchange``/``abort``/``close`` and counts steps,
plus a hook the communicator calls before each operation. Ranks without a spec get their
transport back unwrapped, so an unset ``PYCOLL_FAULT`` costs nothing.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Sequence

from .transport.base import InFrame, OutFrame, Transport
from .wire import decode_header, header_length

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


def wrap(transport: Transport, rank: int, env: str | None = None) -> Transport:
    """``transport`` wrapped with this rank's faults from ``PYCOLL_FAULT``, or itself."""
    text = os.environ.get(ENV, "") if env is None else env
    mine = [f for f in parse(text) if f.rank in (None, rank)] if text else []
    return FaultyTransport(transport, mine) if mine else transport


def before_op_hook(transport: Transport):
    """The communicator's hook before each operation, ``hook(op, seq)``; None for an
    unwrapped transport (looked up once: it sits on every operation's path)."""
    return getattr(transport, "before_op", None)


class FaultyTransport(Transport):
    """Delegates to ``inner``; injects this rank's faults on the way."""

    def __init__(self, inner: Transport, faults: Sequence[Fault]) -> None:
        self.inner, self.faults = inner, list(faults)
        self.rank, self.world = inner.rank, inner.world
        self.name = f"{inner.name}+faults"
        self.op, self.seq, self.step = "", -1, 0

    def __getattr__(self, name):  # anything else a transport offers (conns, subset, ...)
        return getattr(self.inner, name)

    def before_op(self, op: str, seq: int) -> None:
        self.op, self.seq, self.step = op, seq, 0
        for f in self.faults:
            if not f.matches(op, seq):
                continue
            if f.delay:
                time.sleep(f.delay)
            if f.drop_at_seq == seq:
                self.inner.sever(f"fault injection: rank {self.rank} dropped its connections "
                                 f"at {op} seq {seq}")

    def exchange(self, outs: Sequence[OutFrame], ins: Sequence[InFrame], deadline: float,
                 what: str) -> None:
        self.step += 1
        outs = list(outs)
        truncate = False
        for f in self.faults:
            if not f.matches(self.op, self.seq):
                continue
            if f.kill_at_step == self.step:
                os.kill(os.getpid(), signal.SIGKILL)
            if f.stall_at_step == self.step:
                time.sleep(f.stall)
            if f.corrupt_at_step == self.step and outs:
                outs[0], truncate = _corrupt(outs[0], f.corrupt), f.corrupt == "truncate"
            if f.slow_link is not None:
                nbytes = sum(len(o.header) + len(o.payload) for o in outs
                             if f.slow_link in (-1, o.peer))
                if nbytes:
                    time.sleep(nbytes / f.bw)
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
    h = decode_header(memoryview(hdr)[4:4 + header_length(hdr[:4])])
    return OutFrame(frame.peer, replace(h, nbytes=HUGE).encode(), frame.payload)
