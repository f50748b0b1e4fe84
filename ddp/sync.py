"""Model-state collectives outside the backward pass: verify shapes, broadcast states.

Everything here uses the public ``torch.distributed`` API only, so it works on any process
group. The shape check runs before any tensor collective: ranks that built different
models get an error naming the first differing tensor, on every rank, instead of a
broadcast of mismatched sizes that could hang or corrupt memory.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

_BROADCAST_CHUNK = 64 * 1024 * 1024  # bytes per coalesced broadcast: bounded extra memory


def describe(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple, str]]:
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in named]


def verify_same_model(named: Sequence[tuple[str, torch.Tensor]], group) -> None:
    """Raise ValueError on every rank if any rank's (name, shape, dtype) list differs."""
    mine = describe(named)
    world = dist.get_world_size(group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            detail = f"rank 0 has {len(reference)} parameters and buffers, rank {rank} has {len(theirs)}"
        else:
            a, b = next((a, b) for a, b in zip(reference, theirs) if a != b)
            detail = (f"rank 0 has {a[0]!r} with shape {list(a[1])} and {a[2]}, "
                      f"rank {rank} has {b[0]!r} with shape {list(b[1])} and {b[2]}")
        raise ValueError("DistributedDataParallel: the model differs across ranks (" + detail
                         + "); every rank must construct the same model before wrapping it")


def global_rank(group, group_rank: int) -> int:
    """The global rank that ``dist.broadcast(src=...)`` expects for a rank of ``group``."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def broadcast_tensors(tensors: Sequence[torch.Tensor], src_group_rank: int, group) -> None:
    """Overwrite ``tensors`` in place with ``src``'s values, few large broadcasts per dtype."""
    src = global_rank(group, src_group_rank)
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_key.values():
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for t in group_tensors:
            chunk.append(t)
            nbytes += t.numel() * t.element_size()
            if nbytes >= _BROADCAST_CHUNK:
                _broadcast_chunk(chunk, src, group)
                chunk, nbytes = [], 0
        if chunk:
            _broadcast_chunk(chunk, src, group)


def _broadcast_chunk(chunk: list[torch.Tensor], src: int, group) -> None:
    with torch.no_grad():
        if len(chunk) == 1 and chunk[0].is_contiguous():
            dist.broadcast(chunk[0], src=src, group=group)
            return
        flat = torch.cat([t.reshape(-1) for t in chunk])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in chunk:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class BufferBroadcaster:
    """Broadcast a module's buffers each forward, into one reused flat tensor per dtype."""

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        self._groups: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for t in buffers:
            by_key.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, device), ts in by_key.items():
            flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=device)
            self._groups.append((ts, flat))

    def __bool__(self) -> bool:
        return bool(self._groups)

    def broadcast(self, src_group_rank: int, my_group_rank: int, group) -> None:
        src = global_rank(group, src_group_rank)
        with torch.no_grad():
            for ts, flat in self._groups:
                if my_group_rank == src_group_rank:
                    torch.cat([t.reshape(-1) for t in ts], out=flat)
                dist.broadcast(flat, src=src, group=group)
                if my_group_rank != src_group_rank:
                    offset = 0
                    for t in ts:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
