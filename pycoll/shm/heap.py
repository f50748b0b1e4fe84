"""Registered memory: a heap of shared segments that every local rank maps, for user tensors.

``SharedHeap`` is the per-group allocator behind ``pycoll.empty_shared``. It hands out
blocks of memory that every local rank can read and write, so that a collective on tensors
living there can work on the peers' tensors directly instead of staging them (the
registered all_reduce of ``shm.registered``).

Layout. The heap is a list of chunks; a chunk is one ``memfd_create`` segment holding one
region per local rank, of ``length`` bytes each (``PYCOLL_SHM_HEAP_BYTES``, default 64 MiB,
or the request if larger). A block is the same range of every rank's region: local rank r's
tensor is region r's bytes [off, off + n), and it sees its peers' copies of that block at
the same offset of their regions. The memory is sparse: a page costs nothing until touched.

Agreement. Every local rank allocates the same sizes in the same order (the callers run the
allocation as a collective, which checks that), and the allocator is deterministic: a bump
pointer over an address space of chunk offsets that the bump never hands out twice, so
every rank gives the n-th bumped block the same global offset. A freed block is reused only
by agreement: each rank keeps its freed blocks in a cache by rounded size and proposes the
lowest-offset one of the size asked for (``reusable``); the allocation takes it only when
every rank proposed that same block, which means every rank has freed it, and bumps
otherwise. Both choices are made from the same published words, so ranks whose garbage
collectors free in different orders still agree; they merely bump more.

Reuse is what makes per-step buffers cheap (FSDP2 allocates its all_gather outputs and
reduce_scatter inputs every step): a cached block's pages stay resident, so it costs no
page faults and no chunk creation. The cache holds at most ``PYCOLL_SHM_HEAP_CACHE_BYTES``
(default 1 GiB) a rank; a block freed beyond that is released at once, and so is a block
allocated with ``cache=False`` (long-lived buffers, such as DDP's buckets: those a rebuild
replaces are of other sizes, and cached they would hold their pages, and the peers' pages
read through them, until the group is destroyed).

Peers' pages. A rank's RSS counts every page it has mapped, its peers' included, though
such a page exists once (PSS divides it among the ranks). An in-place collective touches a
share of every peer's copy (all_reduce: this rank's 1/P slice of each), which then stays
mapped, and counted in this rank's RSS too, for as long as the block lives. That is the
fastest way, and the default. A block allocated with ``unmap_peers`` (DDP's buckets, which
replace gradient memory users compare) counts once instead: ``unmapper`` keeps at most
``PYCOLL_SHM_PEER_BYTES`` (default 8 MiB) of such blocks' peer pages mapped a rank, for the
first blocks to ask, so that small buckets cost no faults; beyond it each piece's peer pages
are unmapped as the collective finishes with them (``MADV_DONTNEED``: the data stays, only
this rank's page-table entries go) and faulted in again at the next collective (measured:
4-7 ms more per 48 MiB of peer pages, docs/shm.md).

Lifetime. A chunk's segment is created by local rank 0 and mapped by the others through
``/proc/<pid>/fd/<n>``, as the arena is (``arena.py``); rank 0 closes its descriptor once
all have mapped it, so the memory lives exactly as long as a mapping: ``kill -9`` of any
rank leaves nothing behind. A block is freed when the last tensor over it dies (its storage
holds the numpy array whose finaliser frees it): it goes into the cache, or, beyond the
cache's bound, its pages in this rank's region are handed back to the kernel
(``MADV_REMOVE``); a chunk with no live or cached block left that no longer takes
allocations is unmapped by this rank. ``close`` (group destroy) empties the cache and drops the heap's own
references; tensors still alive keep their chunk mapped until they die, and stay valid.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from pycoll import settings
from pycoll.shm import segment

PAGE = 4096
FAULT_AROUND = 64 << 10     # the kernel's default fault_around_bytes


@dataclass(eq=False)
class Chunk:
    """One shared segment: ``size`` regions of ``length`` bytes, one per local rank."""

    index: int
    start: int                  # global offset of the chunk's first byte (regions are alike)
    length: int                 # bytes per rank's region
    mm: mmap.mmap | None
    lo: int                     # address of this rank's region, and its end
    hi: int
    regions: list = field(default_factory=list)     # every rank's region as a numpy uint8 array
    tensors: list = field(default_factory=list)     # the same as torch uint8 tensors (made on demand)
    used: int = 0               # bytes of each region handed out
    live: int = 0               # blocks of this rank still alive
    cached: int = 0             # freed blocks of this rank kept for reuse
    open: bool = True           # still takes allocations


@dataclass(frozen=True, slots=True)
class Block:
    """Where a tensor of this rank lies in the heap: a chunk and the offset in its region."""

    chunk: Chunk
    offset: int

    @property
    def global_offset(self) -> int:
        return self.chunk.start + self.offset


class SharedHeap:
    """The registered memory of one group's local ranks (``local_rank`` of ``size``)."""

    def __init__(self, store, key: str, local_rank: int, size: int, timeout: float,
                 chunk_bytes: int | None = None) -> None:
        self.store, self.key, self.me, self.size, self.timeout = store, key, local_rank, size, timeout
        want = chunk_bytes or settings.get("PYCOLL_SHM_HEAP_BYTES")
        self.chunk_bytes = max(PAGE, -(-want // PAGE) * PAGE)
        self.cache_bytes = settings.get("PYCOLL_SHM_HEAP_CACHE_BYTES")
        self.peer_bytes = settings.get("PYCOLL_SHM_PEER_BYTES")
        # Live blocks allocated with unmap_peers: global offset -> rounded size.
        self._unmapping: dict[int, int] = {}
        # Of those, the ones whose peers' pages stay mapped: global offset -> bytes of them.
        self._kept: dict[int, int] = {}
        self.chunks: list[Chunk] = []
        # Freed blocks kept for reuse: rounded size -> {global offset: (chunk, offset)}.
        self._cache: dict[int, dict[int, tuple[Chunk, int]]] = {}
        self.cached = 0            # bytes in the cache
        self.top = 0               # global offset where the next chunk would start
        self.made = 0              # chunks created so far (their store keys' index)
        self.closed = False
        # Reentrant: a garbage collection inside alloc may run a block's finaliser (free).
        self._lock = threading.RLock()

    # -- allocation ----------------------------------------------------------------------
    def _open_chunk(self):
        return self.chunks[-1] if self.chunks and self.chunks[-1].open else None

    def _fitting(self, n: int):
        """The chunk ``n`` rounded bytes go into, None for a new one: the one placement rule,
        which ``next_offset`` predicts and ``alloc`` follows."""
        cur = self._open_chunk()
        return cur if cur is not None and cur.used + n <= cur.length else None

    def next_offset(self, nbytes: int) -> int:
        """The global offset ``alloc(nbytes)`` will return (every rank must agree on it)."""
        cur = self._fitting(_round(nbytes))
        return cur.start + cur.used if cur is not None else self.top

    def reusable(self, nbytes: int) -> int:
        """The cached block this rank proposes for ``nbytes``: its global offset + 1, 0: none.
        The lowest offset, so that ranks holding the same freed blocks propose the same."""
        with self._lock:
            free = self._cache.get(_round(nbytes))
            return min(free) + 1 if free else 0

    def alloc(self, nbytes: int, deadline: float, reuse: int = 0, cache: bool = True,
              unmap_peers: bool = False) -> tuple[Block, np.ndarray]:
        """A block of ``nbytes`` (> 0) and this rank's copy of it as a numpy uint8 array:
        the cached block ``reuse`` names (what ``reusable`` said, agreed by every rank), or
        a bumped one. ``cache``: whether the block goes into the cache when the array dies
        (else its pages are released at once). ``unmap_peers``: see Peers' pages.

        Collective when it needs a new chunk (local rank 0 creates it, all map it). The
        block lives as long as the array (and whatever keeps the array alive)."""
        if self.closed:
            raise RuntimeError("pycoll.empty_shared: the group's shared heap is closed")
        n = _round(nbytes)
        with self._lock:
            if reuse:
                cur, off = self._take(n, reuse - 1)
                cur.live += 1
                self._policy(cur.start + off, n, unmap_peers)
                return self._array(cur, off, nbytes, n, cache)
            cur = self._fitting(n)
            if cur is None:
                full = self._open_chunk()
                if full is not None:
                    full.open = False
                    self._maybe_drop(full)
                cur = self._new_chunk(max(self.chunk_bytes, n), deadline)
            off = cur.used
            cur.used += n
            cur.live += 1
            self._policy(cur.start + off, n, unmap_peers)
        return self._array(cur, off, nbytes, n, cache)

    def _policy(self, global_offset: int, n: int, unmap_peers: bool) -> None:
        if unmap_peers:
            self._unmapping[global_offset] = n
        else:
            self._unmapping.pop(global_offset, None)
            self._kept.pop(global_offset, None)

    def _take(self, n: int, global_offset: int) -> tuple[Chunk, int]:
        free = self._cache.get(n)
        if not free or global_offset not in free:
            # Every rank proposed this block from its own cache; only close empties it.
            raise RuntimeError("pycoll.empty_shared: the agreed cached block is gone (heap closed?)")
        chunk, off = free.pop(global_offset)
        chunk.cached -= 1
        self.cached -= n
        return chunk, off

    def _array(self, cur: Chunk, off: int, nbytes: int, n: int, cache: bool) -> tuple[Block, np.ndarray]:
        arr = np.frombuffer(cur.mm, dtype=np.uint8, count=nbytes, offset=self.me * cur.length + off)
        weakref.finalize(arr, _release, weakref.ref(self), cur, off, n, cache)
        return Block(cur, off), arr

    def _new_chunk(self, length: int, deadline: float) -> Chunk:
        index, self.made = self.made, self.made + 1
        mm, _ = segment.map_segment(self.store, f"{self.key}/{index}", self.me, self.size, self.size * length,
                                    deadline, "empty_shared", "heap")
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        lo = base + self.me * length
        chunk = Chunk(index, self.top, length, mm, lo, lo + length)
        chunk.regions = [np.frombuffer(mm, dtype=np.uint8, count=length, offset=q * length)
                         for q in range(self.size)]
        self.top += length
        self.chunks.append(chunk)
        return chunk

    # -- lookup --------------------------------------------------------------------------
    def lookup(self, ptr: int, nbytes: int) -> Block | None:
        """The block holding ``nbytes`` at address ``ptr`` of this rank's memory, if any."""
        for c in self.chunks:
            if c.lo <= ptr and ptr + nbytes <= c.hi and c.mm is not None:
                return Block(c, ptr - c.lo)
        return None

    def numpy_views(self, block: Block, nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every local rank's copy of ``nbytes`` at ``block``, typed, in rank order."""
        o = block.offset
        return [r[o:o + nbytes].view(dtype) for r in block.chunk.regions]

    def tensor_views(self, block: Block, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        c, o = block.chunk, block.offset
        if not c.tensors:
            c.tensors = [torch.from_numpy(r) for r in c.regions]
        return [t[o:o + nbytes].view(dtype) for t in c.tensors]

    # -- peers' pages ---------------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Bytes of peers' pages that ``unmap_peers`` blocks keep mapped on this rank."""
        return sum(self._kept.values())

    def unmapper(self, block: Block, touched: int):
        """None when this rank keeps the peers' pages of ``block`` that a collective touches
        (``touched`` bytes of each peer's copy) mapped: a block without ``unmap_peers``, or
        one within ``peer_bytes``; else ``unmap(lo, hi)``, which drops this rank's mapping
        of bytes [lo, hi) of ``block`` in every peer's copy."""
        where = block.global_offset
        cost = touched * (self.size - 1)
        with self._lock:
            key = next((g for g, n in self._unmapping.items() if g <= where < g + n), None)
            if key is None:
                return None
            have = self._kept.get(key, 0)
            if cost <= have:
                return None
            if self.kept - have + cost <= self.peer_bytes:
                self._kept[key] = cost
                return None
        return functools.partial(self._unmap_peers, block.chunk, block.offset)

    def _unmap_peers(self, chunk: Chunk, offset: int, lo: int, hi: int) -> None:
        mm = chunk.mm
        # Whole fault-around windows: a read fault maps the cached pages of its aligned
        # window, before the piece as well as after it, and the next piece's faults would
        # leave those behind. (Unmapping a neighbour's pages costs it a fault, nothing else.)
        a = (offset + lo) // FAULT_AROUND * FAULT_AROUND
        b = min(-(-(offset + hi) // FAULT_AROUND) * FAULT_AROUND, chunk.length)
        if mm is None or b <= a:
            return
        for q in range(self.size):
            if q != self.me:
                mm.madvise(mmap.MADV_DONTNEED, q * chunk.length + a, b - a)

    # -- freeing -------------------------------------------------------------------------
    def _maybe_drop(self, chunk: Chunk) -> None:
        """Unmap ``chunk`` on this rank once it takes no allocations and holds no live block."""
        if chunk.live or chunk.cached or (chunk.open and not self.closed) or chunk.mm is None:
            return
        if chunk in self.chunks:
            self.chunks.remove(chunk)
        chunk.regions, chunk.tensors = [], []
        mm, chunk.mm = chunk.mm, None
        try:
            mm.close()
        except BufferError:
            pass   # a view somebody still holds; the mapping goes with it

    def free(self, chunk: Chunk, offset: int, n: int, cache: bool = True) -> None:
        with self._lock:
            chunk.live -= 1
            mm = chunk.mm
            if cache and mm is not None and not self.closed and self.cached + n <= self.cache_bytes:
                self._cache.setdefault(n, {})[chunk.start + offset] = (chunk, offset)
                chunk.cached += 1
                self.cached += n
                return
            self._policy(chunk.start + offset, n, False)
            if mm is not None and not mm.closed:
                try:   # hand this rank's pages of the block back, and unmap its peers'
                    mm.madvise(mmap.MADV_REMOVE, self.me * chunk.length + offset, n)
                    self._unmap_peers(chunk, offset, 0, n)
                except (OSError, ValueError):
                    pass
            self._maybe_drop(chunk)

    def live_blocks(self) -> int:
        return sum(c.live for c in self.chunks)

    def cached_blocks(self) -> int:
        return sum(c.cached for c in self.chunks)

    def close(self) -> None:
        """Group destroy: no more allocations; chunks without live tensors are unmapped now,
        the others when their last tensor dies."""
        with self._lock:
            self.closed = True
            self._cache.clear()
            self.cached = 0
            self._unmapping.clear()
            self._kept.clear()
            for c in list(self.chunks):
                c.cached = 0
                c.open = False
                self._maybe_drop(c)
            for c in self.chunks:   # live tensors keep these mapped (through their own arrays)
                c.regions, c.tensors, c.mm = [], [], None
            self.chunks = []


def _release(heap_ref, chunk: Chunk, offset: int, n: int, cache: bool) -> None:
    heap = heap_ref()
    if heap is not None:
        heap.free(chunk, offset, n, cache)


def _round(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)
