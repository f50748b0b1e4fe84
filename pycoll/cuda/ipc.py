"""The ipc path: CUDA IPC between the processes of one host, several of them maybe on one GPU.

Set-up (at the group's first CUDA call): each rank allocates one registered device buffer of
two slots (double-buffered by round parity, ``PYCOLL_CUDA_IPC_SLOT_BYTES``, default 32 MiB each)
and three pairs of interprocess CUDA events (``ready``, ``mid``, ``done``, one per parity),
exports them with torch's own IPC calls (``untyped_storage()._share_cuda_()``,
``Event.ipc_handle()``), publishes the handles through the Store and opens every peer's
(``UntypedStorage._new_shared_cuda``, ``Event.from_ipc_handle``). The buffers are reused by every
later collective. A host-side ``ShmArena`` (shm/arena.py: futex barriers, pid checks,
signature check) orders the ranks' hosts; the events order their streams. No cupy needed.

A round of a collective, on the caller's current stream, as the shared-memory algorithms do it:

1. wait for every peer's ``done[p]``: peers have finished reading my slot ``p`` (round r-2);
2. write my part into my slot ``p``; record ``ready[p]``;
3. host barrier (the first of each collective also checks every rank's signature);
4. wait for the peers' ``ready[p]`` whose slots I read; read/reduce straight from their slots;
5. record ``done[p]``.

The barrier in 3 makes every record in 2 precede the waits in 4 (a stream waits for the most
recent record at the time of the wait call), and slot ``p`` is written again only two rounds
later, after a barrier that every reader of round r passed after enqueuing its reads, so the
waits in 1 cover them. Large all_reduce with more than two ranks adds a phase: rank r reduces
slice r of every slot into its own slot, records ``mid[p]``, barrier, and every rank copies the
reduced slices out (each rank reads about 2n bytes instead of (P-1)n). Reductions run in rank
order, so every rank gets bitwise the same result.

The host blocks in the barriers only (never on the device), so a call returns once its peers
have reached the same collective. Point-to-point calls take host staging (c10d/backend.py).
"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import torch

from pycoll import settings, torch_compat
from pycoll.algorithms.schedule import chunks, displacements
from pycoll.shm.rounds import counts_hash, describe_words, signature
from pycoll.shm.arena import ShmArena

ONE_SHOT_BYTES = 256 << 10
KEY = "pycoll/cuda/ipc"
KINDS = ("ready", "mid", "done")


class IpcPath:
    name = "ipc"

    def __init__(self, store, rank: int, world: int, device: torch.device, timeout: float, facts) -> None:
        self.rank, self.world, self.device, self.timeout = rank, world, device, timeout
        slot = settings.get("PYCOLL_CUDA_IPC_SLOT_BYTES")
        self.slot = max(1 << 16, slot // 4096 * 4096)
        self.arena = ShmArena(store, f"{KEY}/arena", rank, world, list(range(world)), timeout, slot_bytes=4096)
        self.peers = [q for q in range(world) if q != rank]
        self.bufs: list = [None] * world
        self.peer_events: list = [None] * world
        self._setup(store, facts)
        self.arena.sync(time.monotonic() + timeout, "cuda ipc init")  # every rank has opened every handle
        self.seq = self.rounds = 0
        self._views: dict = {}
        self._words, self._what, self._first, self._deadline = (), "", False, 0.0

    def _setup(self, store, facts) -> None:
        """Allocate, export and open the buffers and events (the only CUDA-IPC-specific part)."""
        rank, device = self.rank, self.device
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            self.buf = torch.empty(2 * self.slot, dtype=torch.uint8, device=device)
            self.events = {k: [torch.cuda.Event(interprocess=True) for _ in range(2)] for k in KINDS}
            for evs in self.events.values():
                for e in evs:
                    e.record(stream)  # created, and complete: the first rounds wait on them
            mine = {"share": torch_compat.share_cuda_storage(self.buf.untyped_storage()),
                    "events": {k: [e.ipc_handle() for e in evs] for k, evs in self.events.items()}}
            store.set(f"{KEY}/{rank}", msgpack.packb(mine, use_bin_type=True))
            self.bufs[rank] = self.buf
            for q in self.peers:
                info = msgpack.unpackb(store.get(f"{KEY}/{q}"), raw=False)
                local = facts[rank].visible.index(facts[q].gpu)  # the peer's GPU, as this process numbers it
                share = list(info["share"])
                share[0] = local
                storage = torch_compat.open_cuda_storage(share)
                peer_dev = torch.device("cuda", local)
                self.bufs[q] = torch.empty(0, dtype=torch.uint8, device=peer_dev).set_(storage)[:2 * self.slot]
                self.peer_events[q] = {k: [torch.cuda.Event.from_ipc_handle(peer_dev, h) for h in hs]
                                       for k, hs in info["events"].items()}

    # Stream ordering; a host-memory stand-in (tests/ranks/test_cuda.py) replaces these three.
    def _record(self, kind: str, p: int) -> None:
        self.events[kind][p].record(torch.cuda.current_stream())

    def _wait(self, q: int, kind: str, p: int) -> None:
        torch.cuda.current_stream().wait_event(self.peer_events[q][kind][p])

    def _device_sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    # -- rounds ------------------------------------------------------------------------------
    def _start(self, op: str, dtype: torch.dtype, numel: int, redop: str = "", root: int = -1,
               extra: int = 0) -> None:
        self.seq += 1
        self._words = signature(op, self.seq, dtype, numel, redop, root, extra)
        self._what = f"cuda ipc {op} seq {self.seq}"
        self._first = True
        self._deadline = time.monotonic() + self.timeout

    def _sync(self) -> None:
        """Host barrier of all ranks; the first of a collective also checks signatures."""
        if self._first:
            self.arena.publish(self._words)
        self.arena.sync(self._deadline, self._what)
        if self._first:
            self._first = False
            self.arena.check_signatures(self._words, describe_words)

    def _begin(self) -> int:
        self.rounds += 1
        p = self.rounds & 1
        for q in self.peers:
            self._wait(q, "done", p)
        return p

    def _exchange(self, kind: str, p: int, read=None) -> None:
        """Record my ``kind`` event, barrier, wait for the events of the peers I read (``read``:
        None = all, an int = that rank, -1 = none)."""
        self._record(kind, p)
        self._sync()
        srcs = self.peers if read is None else [] if read < 0 or read == self.rank else [read]
        for q in srcs:
            self._wait(q, kind, p)

    def _end(self, p: int) -> None:
        self._record("done", p)

    def _view(self, q: int, p: int, dtype: torch.dtype) -> torch.Tensor:
        key = (q, p, dtype)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = self.bufs[q][p * self.slot:(p + 1) * self.slot].view(dtype)
        return v

    def _local(self, v: torch.Tensor) -> torch.Tensor:
        return v if v.device == self.device else v.to(self.device)

    def _reduce(self, out: torch.Tensor, views: list, red) -> None:
        """``out`` = the reduction of ``views`` in rank order (``out`` aliases none of them)."""
        vs = [self._local(v) for v in views]
        if len(vs) == 1:
            out.copy_(vs[0])
            return
        red.combine(vs[0], vs[1], out)
        for v in vs[2:]:
            red.kernel(out, v)

    def _cap(self, t: torch.Tensor) -> int:
        return self.slot // t.element_size()

    # -- primitives --------------------------------------------------------------------------
    def check_reduction(self, dtype, red) -> None:
        pass  # torch's CUDA kernels reduce every dtype and op that reduce_ops accepts

    def all_reduce(self, t, red) -> None:
        n, me = t.numel(), self.rank
        if n == 0:
            return
        red.prepare(t)
        self._start("all_reduce", t.dtype, n, red.name)
        two_phase = self.world > 2 and n * t.element_size() > ONE_SHOT_BYTES
        for off in range(0, n, self._cap(t)):
            cnt = min(self._cap(t), n - off)
            chunk = t[off:off + cnt]
            p = self._begin()
            self._view(me, p, t.dtype)[:cnt].copy_(chunk)
            self._exchange("ready", p)
            views = [self._view(q, p, t.dtype)[:cnt] for q in range(self.world)]
            if not two_phase:
                self._reduce(chunk, views, red)
            else:
                sl = chunks(cnt, self.world)
                s0, c0 = sl[me]
                self._reduce(chunk[s0:s0 + c0], [v[s0:s0 + c0] for v in views], red)
                views[me][s0:s0 + c0].copy_(chunk[s0:s0 + c0])
                self._exchange("mid", p)
                for q, (sq, cq) in enumerate(sl):
                    if q != me and cq:
                        chunk[sq:sq + cq].copy_(views[q][sq:sq + cq])
            self._end(p)
        red.finish(t)

    def reduce(self, t, root: int, red) -> None:
        n = t.numel()
        if n == 0:
            return
        src = t
        if red.factor is not None:
            src = t.clone()
            red.prepare(src)
        self._start("reduce", t.dtype, n, red.name, root)
        for off in range(0, n, self._cap(t)):
            cnt = min(self._cap(t), n - off)
            p = self._begin()
            self._view(self.rank, p, t.dtype)[:cnt].copy_(src[off:off + cnt])
            self._exchange("ready", p, None if self.rank == root else -1)
            if self.rank == root:
                self._reduce(t[off:off + cnt], [self._view(q, p, t.dtype)[:cnt] for q in range(self.world)], red)
            self._end(p)
        if self.rank == root:
            red.finish(t)

    def broadcast(self, t, root: int) -> None:
        n = t.numel()
        if n == 0:
            return
        self._start("broadcast", t.dtype, n, root=root)
        for off in range(0, n, self._cap(t)):
            cnt = min(self._cap(t), n - off)
            p = self._begin()
            if self.rank == root:
                self._view(root, p, t.dtype)[:cnt].copy_(t[off:off + cnt])
            self._exchange("ready", p, root)
            if self.rank != root:
                t[off:off + cnt].copy_(self._view(root, p, t.dtype)[:cnt])
            self._end(p)

    def _gather(self, op: str, out, inp, root: int) -> None:
        n = inp.numel()
        if n == 0:
            return
        self._start(op, inp.dtype, n, root=root)
        reads = root < 0 or self.rank == root
        for off in range(0, n, self._cap(inp)):
            cnt = min(self._cap(inp), n - off)
            p = self._begin()
            self._view(self.rank, p, inp.dtype)[:cnt].copy_(inp[off:off + cnt])
            self._exchange("ready", p, None if reads else -1)
            if reads:
                for q in range(self.world):
                    src = inp[off:off + cnt] if q == self.rank else self._view(q, p, inp.dtype)[:cnt]
                    out[q * n + off:q * n + off + cnt].copy_(src)
            self._end(p)

    def all_gather(self, out, inp) -> None:
        self._gather("all_gather", out, inp, -1)

    def gather(self, out, inp, root: int) -> None:
        self._gather("gather", out, inp, root)

    def scatter(self, out, inp, root: int) -> None:
        n, me = out.numel(), self.rank
        if n == 0:
            return
        self._start("scatter", out.dtype, n, root=root)
        part = self._cap(out) // self.world
        for off in range(0, n, part):
            cnt = min(part, n - off)
            p = self._begin()
            if me == root:
                mine = self._view(me, p, out.dtype)
                for q in range(self.world):
                    mine[q * part:q * part + cnt].copy_(inp[q * n + off:q * n + off + cnt])
            self._exchange("ready", p, root)
            out[off:off + cnt].copy_(self._view(root, p, out.dtype)[me * part:me * part + cnt])
            self._end(p)

    def reduce_scatter(self, out, inp, counts, red) -> None:
        if red.factor is not None:
            inp = inp.clone()
            red.prepare(inp)
        top, me = max(counts, default=0), self.rank
        if top:
            self._start("reduce_scatter", inp.dtype, inp.numel(), red.name, extra=counts_hash(counts))
            part, disp = self._cap(inp) // self.world, displacements(counts)
            for lo in range(0, top, part):
                p = self._begin()
                mine = self._view(me, p, inp.dtype)
                for q, c in enumerate(counts):
                    c = max(0, min(part, c - lo))
                    mine[q * part:q * part + c].copy_(inp[disp[q] + lo:disp[q] + lo + c])
                self._exchange("ready", p)
                c = max(0, min(part, counts[me] - lo))
                if c:
                    self._reduce(out[lo:lo + c], [self._view(q, p, inp.dtype)[me * part:me * part + c]
                                                  for q in range(self.world)], red)
                self._end(p)
        red.finish(out)

    def all_to_all(self, out, inp, send_counts, recv_counts) -> None:
        me = self.rank
        self._start("all_to_all", inp.dtype, self.world)
        top = self._allmax(max((*send_counts, *recv_counts), default=0))
        part, sd, rd = self._cap(inp) // self.world, displacements(send_counts), displacements(recv_counts)
        for lo in range(0, top, part):
            p = self._begin()
            mine = self._view(me, p, inp.dtype)
            for q, c in enumerate(send_counts):
                c = max(0, min(part, c - lo))
                mine[q * part:q * part + c].copy_(inp[sd[q] + lo:sd[q] + lo + c])
            self._exchange("ready", p)
            for q, c in enumerate(recv_counts):
                c = max(0, min(part, c - lo))
                if c:
                    out[rd[q] + lo:rd[q] + lo + c].copy_(self._view(q, p, inp.dtype)[me * part:me * part + c])
            self._end(p)

    def _allmax(self, value: int) -> int:
        """The largest ``value`` of all ranks, through the arena's host slots (one barrier)."""
        par, i64 = self.arena.next_parity(), np.dtype(np.int64)
        self.arena.numpy_slots(par, i64)[self.rank][0] = value
        self._sync()
        return max(int(s[0]) for s in self.arena.numpy_slots(par, i64))

    def barrier(self) -> None:
        self._device_sync()
        self._start("barrier", torch.uint8, 0)
        self._sync()

    # -- lifecycle ---------------------------------------------------------------------------
    def abort_peers(self, why: str) -> None:
        self.arena.abort()

    def close(self, abort: bool = False) -> None:
        if abort:
            self.arena.abort()
        else:
            self._device_sync()  # my reads of peers' slots are done
        self._views.clear()
        self.bufs = self.peer_events = None
        self.arena.close()
