"""Gradient buckets: the pure assignment function, the flat buffers, and the hook-facing view.

``assign_buckets`` decides which parameters share a bucket; it does no I/O and touches no
tensor, so it is unit-tested on plain numbers. ``Bucket`` owns one flat, dtype-homogeneous
buffer that is allocated once and reused every step; each parameter's gradient lives in a
view of it. ``GradBucket`` is what a communication hook sees (torch's contract: ``buffer()``,
``index()``, ``parameters()``, ``gradients()``, ``is_last()``). ``sharing_pycoll`` says
whether a group can keep such buffers in pycoll's registered shared memory;
``overlap_pays`` whether reducing buckets during backward can gain anything on this host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import os
from typing import Callable, Hashable, Sequence

import torch

MB = 1024 * 1024


def assign_buckets(sizes: Sequence[int], keys: Sequence[Hashable], order: Sequence[int],
                   first_cap: int, cap: int) -> list[list[int]]:
    """Group parameter indices into buckets; return them in launch order.

    ``sizes[i]`` is parameter i's gradient size in bytes and ``keys[i]`` what must be equal
    inside one bucket (dtype, device). ``order`` is the order gradients are expected to
    become ready (reverse ``parameters()`` order at first, the observed order after the
    first iteration). Walking that order, each key has one open bucket; the parameter that
    brings it to ``first_cap`` (its key's first bucket) or ``cap`` (the others) bytes
    closes it, as torch's reducer does. Buckets are returned sorted by when their first
    member is expected to be ready, so bucket i is always launched before bucket i + 1.
    """
    if first_cap <= 0 or cap <= 0:
        raise ValueError(f"bucket caps must be positive, got first_cap={first_cap}, cap={cap}")
    position = {index: pos for pos, index in enumerate(order)}
    if len(position) != len(order):
        raise ValueError("order contains a parameter twice")
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    closed_per_key: dict[Hashable, int] = {}
    done: list[list[int]] = []
    for index in order:
        key = keys[index]
        members, nbytes = open_buckets.get(key, ([], 0))
        members.append(index)
        nbytes += sizes[index]
        limit = first_cap if closed_per_key.get(key, 0) == 0 else cap
        if nbytes >= limit:
            done.append(members)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (members, nbytes)
    done.extend(members for members, _ in open_buckets.values())
    done.sort(key=lambda members: position[members[0]])
    return done


@dataclass
class Bucket:
    """One flat buffer and the views of it that hold its parameters' gradients."""

    index: int
    param_indices: list[int]
    params: list[torch.Tensor]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    shared: bool = False   # the buffer lies in memory the group's ranks share (pycoll.empty_shared)

    @classmethod
    def allocate(cls, index: int, param_indices: list[int], params: list[torch.Tensor],
                 alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> "Bucket":
        """``alloc(numel, dtype)``: a zeroed buffer in shared memory (None: ordinary memory)."""
        first = params[0]
        numel = sum(p.numel() for p in params)
        if alloc is not None:
            buffer = alloc(numel, first.dtype)
        else:
            buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return cls(index, param_indices, params, buffer, views, alloc is not None)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class GradBucket:
    """The view of one bucket that a communication hook receives (torch's GradBucket API)."""

    __slots__ = ("_index", "_buffer", "_params", "_views", "_is_last")

    def __init__(self, index: int, buffer: torch.Tensor, params: list[torch.Tensor],
                 views: list[torch.Tensor], is_last: bool) -> None:
        self._index, self._buffer, self._params = index, buffer, params
        self._views, self._is_last = views, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer; the hook's future must resolve to a tensor of its shape."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter gradients, as views of ``buffer()``."""
        return list(self._views)

    def is_last(self) -> bool:
        return self._is_last

    def is_the_last_bucket_to_allreduce(self) -> bool:  # torch's older name
        return self._is_last


def shadow_bucket(bucket: Bucket, is_last: bool) -> GradBucket:
    """A zero-filled stand-in for ``bucket``, for a rank that has joined (uneven inputs).
    A shared bucket is zeroed itself: its peers reduce theirs in place, and a collective
    in place needs every rank's tensor at the same place of the shared memory."""
    if bucket.shared:
        bucket.buffer.zero_()
        return GradBucket(bucket.index, bucket.buffer, bucket.params, bucket.views, is_last)
    zeros = torch.zeros_like(bucket.buffer)
    views, offset = [], 0
    for p in bucket.params:
        views.append(zeros[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return GradBucket(bucket.index, zeros, bucket.params, views, is_last)


def sharing_pycoll(group):
    """The ``pycoll`` module when ``group`` is a pycoll group whose ranks share memory (its
    buffers can be registered: ``pycoll.empty_shared``), else None. ddp/ works without
    pycoll installed; every rank decides alike (the group's mode is the same everywhere)."""
    try:
        import pycoll
    except ImportError:
        return None
    return pycoll if pycoll.can_share_memory(group) else None


def overlap_pays(threads: Sequence[int], cores: int) -> bool:
    """Whether a bucket's all-reduce during backward can run beside the compute.

    ``threads[r]``: the torch threads local rank r computes with; ``cores``: the cores the
    ranks may run on (the union of their affinity masks). Each rank reduces on one more
    thread (its process group's worker). Only where the cores leave every worker one of its
    own does the overlap hide the reduction; otherwise the reduction's copies take a core
    from some rank's backward (it is CPU work, not a DMA engine's), so overlapping adds
    switches and cache misses and hides nothing (docs/ddp.md, "No overlap where no core is
    spare")."""
    return cores >= sum(t + 1 for t in threads)


def host_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask, as torch's own thread count)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))
