"""Runs a schedule over a transport: the hot path.

Buffers are flat, contiguous, 1-D tensors of the collective's dtype. Communication actions
are cut into segments of at most ``segment_bytes``; each segment is one frame with its own
header, so a receive-and-reduce needs one segment of scratch memory per peer (reused across
collectives), never a chunk-sized copy. Reductions are torch kernels on slices (no Python
per-element work); sends and receives use the tensors' own memory (no staging copies).
"""

from __future__ import annotations

import ctypes
import time

import torch

from pycoll import settings
from pycoll.algorithms.schedule import Copy, Recv, Reduce, Schedule, Send
from pycoll.core.kernels import copy
from pycoll.core.reductions import Reduction
from pycoll.transport.base import InFrame, OutFrame, Transport
from pycoll.wire import DATA, Header, Signature

DEFAULT_SEGMENT_BYTES = settings.SETTINGS["PYCOLL_SEGMENT_BYTES"].default


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous tensor's bytes (any dtype, bfloat16 too).

    Built from the data pointer (a third of the cost of ``t.view(uint8).numpy()`` on the
    latency path); the ctypes array keeps ``t`` alive as long as the view exists.
    """
    n = t.nbytes
    if n == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_char * n).from_address(t.data_ptr())
    raw.owner = t
    return memoryview(raw).cast("B")


class Executor:
    def __init__(self, transport: Transport, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.transport = transport
        self.segment_bytes = max(64, segment_bytes)
        self._scratch: dict[int, torch.Tensor] = {}  # peer -> uint8 scratch, reused
        self.on_step = None  # observer hook after each step (core/observer.py); None: nobody watches
        self.current = None  # (schedule, signature, itemsize) of the run in progress, and
        self.step = -1       # its step index: see progress()

    def _scratch_for(self, peer: int, nbytes: int) -> torch.Tensor:
        buf = self._scratch.get(peer)
        if buf is None or buf.numel() < nbytes:
            # 64-byte padding keeps the scratch away from a 16-byte-past-4KiB alias with
            # the destination, which makes glibc's memcpy 10x slower (DESIGN.md).
            buf = torch.empty(nbytes + 64, dtype=torch.uint8)[64:]
            self._scratch[peer] = buf
        return buf

    def run(self, sched: Schedule, bufs: dict[str, torch.Tensor], sig: Signature,
            reduction: Reduction | None, deadline: float) -> None:
        if not sched.steps:
            return
        dtype = next(iter(bufs.values())).dtype
        for name, n in sched.temps.items():
            bufs[name] = torch.empty(n, dtype=dtype)
        views = _LazyViews(bufs)
        isz = dtype.itemsize
        seg_elems = max(1, self.segment_bytes // isz)
        what = f"{sig.op} seq {sig.seq}"
        # A header's "step" is the message's ordinal on its (sender, receiver) pair, not the
        # sender's step index: ranks idle in a round have no step there, so step indices
        # differ between peers, while per-pair message order is what schedules agree on.
        n_sent: dict[int, int] = {}
        n_recv: dict[int, int] = {}
        self.current, tracer = (sched, sig, isz), self.on_step
        t = time.monotonic() if tracer is not None else 0.0
        for i, step in enumerate(sched.steps):
            self.step = i
            if isinstance(step[0], (Copy, Reduce)):
                self._local(step, bufs, reduction)
                if tracer is not None:
                    t = _trace(tracer, sig, sched.name, i, step, isz, t)
                continue
            outs: list[OutFrame] = []
            ins: list[InFrame] = []
            for a in step:
                mv = views[a.buf]
                counter = n_sent if isinstance(a, Send) else n_recv
                msg = counter.get(a.peer, 0)
                counter[a.peer] = msg + 1
                for seg, (lo, n) in enumerate(_segments(a.start, a.count, seg_elems)):
                    nbytes = n * isz
                    if isinstance(a, Send):
                        header = Header(DATA, sig, msg, seg, nbytes).encode()
                        outs.append(OutFrame(a.peer, header, mv[lo * isz:lo * isz + nbytes]))
                        continue
                    expect = Header(DATA, sig, msg, seg, nbytes)
                    if isinstance(a, Recv):
                        ins.append(InFrame(a.peer, expect, mv[lo * isz:lo * isz + nbytes]))
                    else:
                        scratch = self._scratch_for(a.peer, nbytes)
                        ins.append(InFrame(a.peer, expect, byte_view(scratch)[:nbytes],
                                           _reducer(reduction, bufs[a.buf], lo, n, scratch, dtype)))
            self.transport.exchange(outs, ins, deadline, what)
            if tracer is not None:
                t = _trace(tracer, sig, sched.name, i, step, isz, t)
        self.current = None

    def progress(self, live: bool = True) -> tuple | None:
        """The run in progress, for the hang dump: (schedule, signature, itemsize, step index,
        the transport's account of the step or None, the group rank of each schedule rank);
        None when idle."""
        cur = self.current
        if cur is None:
            return None
        t = self.transport
        progress = getattr(t, "progress", None) if live else None
        return (*cur, self.step, progress() if progress is not None else None,
                list(getattr(t, "ranks", range(t.world))))

    @staticmethod
    def _local(step, bufs, reduction) -> None:
        for a in step:
            src = bufs[a.src][a.src_start:a.src_start + a.count]
            dst = bufs[a.dst][a.dst_start:a.dst_start + a.count]
            if isinstance(a, Copy):
                copy(dst, src)
            else:
                reduction.reduce(dst, src)


class _LazyViews(dict):
    """Byte views of the buffers, made on first use (local-only steps need none)."""

    def __init__(self, bufs: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.bufs = bufs

    def __missing__(self, name: str) -> memoryview:
        view = self[name] = byte_view(self.bufs[name])
        return view


def _trace(on_step, sig: Signature, algo: str, i: int, step, isz: int, t0: float) -> float:
    """Tell the observers of one step; a step starts where the previous one ended (one clock
    read per step)."""
    t = time.monotonic()
    on_step(sig, algo, i, step, isz, t0, t)
    return t


def _segments(start: int, count: int, seg_elems: int):
    if count == 0:
        yield start, 0
        return
    end = start + count
    while start < end:
        n = min(seg_elems, end - start)
        yield start, n
        start += n


def _reducer(reduction: Reduction, buf: torch.Tensor, lo: int, n: int, scratch: torch.Tensor,
             dtype: torch.dtype):
    def done() -> None:
        reduction.reduce(buf[lo:lo + n], scratch[:n * dtype.itemsize].view(dtype))
    return done
