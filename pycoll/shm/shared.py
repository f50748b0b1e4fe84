"""``pycoll.empty_shared``: tensors in memory that a group's local ranks share (registered buffers).

As NCCL's ``ncclMemAlloc`` + ``ncclCommRegister``: every rank of the group calls
``empty_shared`` in the same order with the same shapes and dtypes (it is a collective);
each gets its own tensor, and the group's collectives that recognise such tensors on all
local ranks at the same place work on them in place (all_reduce: ``shm.registered``).
On a group whose ranks do not all share one host, or that is not on shared memory, it
returns an ordinary ``torch.empty`` tensor without communicating (``can_share_memory`` says
which), so code can call it unconditionally on pycoll groups.
"""

from __future__ import annotations

import math

import torch

from pycoll import torch_compat
from pycoll.shm import registered as shm_registered
from pycoll.core.reductions import SUPPORTED_DTYPES
from pycoll.shm.heap import SharedHeap


def _backend(group):
    pg = group if group is not None else torch_compat.default_group()
    if getattr(pg, "communicator", None) is not None:
        return pg
    backend = torch_compat.cpu_backend(pg)
    if getattr(backend, "communicator", None) is None:
        raise ValueError(f"pycoll.empty_shared: {pg!r} is not a pycoll process group")
    return backend


def can_share_memory(group=None) -> bool:
    """Whether ``group`` is a pycoll group whose ranks all run on one host over shared
    memory (mode "shm"), so that ``empty_shared`` gives registered memory. False for
    groups of other backends."""
    try:
        return _backend(group).communicator.mode == "shm"
    except ValueError:
        return False


def empty_shared(shape, dtype: torch.dtype = torch.float32, group=None, *,
                 cache: bool = True, unmap_peers: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor in ``group``'s shared heap (a collective: call it on
    every rank of the group, in the same order, with the same shape and dtype).

    The memory is freed when the tensor (and every view of it) is gone: with ``cache``
    (the default, for buffers made anew every step) the group keeps its block, pages
    resident, for its next tensor of the same size; with ``cache=False`` (long-lived
    buffers) its pages go back to the system at once. Destroying the group frees what no
    tensor uses any more, and a killed process leaks nothing. A tensor stays valid after
    its group is destroyed, as ordinary memory.

    The in-place collectives map the part of every peer's copy that this rank works on,
    and those pages count in this rank's RSS as well as in the peer's (once in PSS and in
    a cgroup's charge). With ``unmap_peers`` this rank keeps at most
    ``PYCOLL_SHM_PEER_BYTES`` (8 MiB) of them mapped, across such tensors, and unmaps the
    rest as each collective finishes with them: RSS then counts the memory once, for 4-7
    ms more per 48 MiB of peer pages a collective (faulting them in again; docs/shm.md).
    DDP's buckets are made so."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"pycoll.empty_shared: dtype {dtype} is not supported")
    backend = _backend(group)
    comm = backend.communicator
    if comm.mode != "shm":
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    got: list = []

    def task(seq: int, deadline: float) -> None:
        # Made here, where the group's ops run one at a time: two threads calling at once
        # make one heap.
        if comm.heap is None:
            arena = comm.arena
            comm.heap = SharedHeap(backend.get_group_store(), "pycoll/heap", arena.me, arena.size,
                                   comm.timeout)
        got.append(shm_registered.allocate(comm.arena, comm.heap, nbytes, seq, deadline, cache, unmap_peers))

    comm.submit("empty_shared", [], task, True).wait()
    if got[0] is None:
        return torch.empty(shape, dtype=dtype)
    _, arr = got[0]
    return torch.from_numpy(arr).view(dtype).view(shape)


def shared_scratch(key, numel: int, dtype: torch.dtype, group=None, *,
                   unmap_peers: bool = False) -> torch.Tensor:
    """A flat registered tensor that ``group`` keeps under ``key`` for reuse: the same
    tensor at every call while ``numel`` and ``dtype`` stay the same, a new one (through
    ``empty_shared``, so a collective) when they change or at the first call. For per-step
    buffers such as a DDP comm hook's compressed bucket: every rank must make the same
    calls in the same order. An ordinary tensor on pycoll groups that cannot share memory.

    The caller owns the contents; a tensor is reused while an earlier user may still hold
    it, so only one use of a key may be in flight at a time. Destroying the group drops them
    (``Communicator.shutdown``). ``unmap_peers``: ``empty_shared``'s, for a new tensor."""
    cache = _backend(group).communicator.scratch
    t = cache.get(key)
    if t is None or t.numel() != numel or t.dtype != dtype:
        cache.pop(key, None)    # (its memory goes back to the heap before the new block)
        t = cache[key] = empty_shared(numel, dtype, group, cache=False, unmap_peers=unmap_peers)   # long-lived
    return t


def is_registered(t: torch.Tensor, group=None) -> bool:
    """Whether ``t``'s memory lies in ``group``'s shared heap (made by ``empty_shared``)."""
    try:
        heap = _backend(group).communicator.heap
    except ValueError:
        return False
    return (heap is not None and t.device.type == "cpu" and t.numel() > 0
            and heap.lookup(t.data_ptr(), t.numel() * t.element_size()) is not None)
