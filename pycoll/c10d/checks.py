"""Argument checks that run before any communication, with gloo's exception types or clearer,
for CPU and CUDA tensors alike.

Also the reshaping every collective needs: a flat contiguous view of a tensor, or, for a
non-contiguous tensor, a contiguous copy plus the function that writes results back (gloo
rejects such tensors; handling them costs one copy and no surprise). Views whose memory
does not hold their values as they read (negative and conjugate views) are resolved the
same way, and tensors whose elements share memory are refused as outputs.
"""

from __future__ import annotations

from typing import Callable

import torch

from pycoll.core.reductions import SUPPORTED_DTYPES
from pycoll.torch_compat import has_internal_overlap

_STRIDED = torch.strided
DEVICES = ("cpu", "cuda")


def check_tensor(t, what: str) -> torch.Tensor:
    """A dense tensor of a supported dtype on a CPU or CUDA device, or a clear error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{what}: {t.layout} tensors are not supported (only dense, strided tensors)")
    if t.device.type not in DEVICES:
        raise ValueError(f"{what}: tensors on device {t.device} are not supported (CPU and CUDA only)")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {t.dtype} is not supported")
    return t


def _dense_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.is_cpu and t.dtype in SUPPORTED_DTYPES


def plain_cpu(t) -> bool:
    """The latency path's whole check: a dense CPU tensor of a supported dtype whose memory
    holds its values as they read (``_plain``). Anything else goes through the checks below,
    which say what is wrong."""
    # _dense_cpu and _plain spelled out: this runs once per small op.
    return (isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.is_cpu and t.dtype in SUPPORTED_DTYPES
            and t.is_contiguous() and not (t.is_neg() or t.is_conj()))


def check_tensors(ts, what: str, exactly: int | None = None) -> list[torch.Tensor]:
    ts = list(ts)
    if exactly is not None and len(ts) != exactly:
        raise ValueError(f"{what}: expected {exactly} tensor(s) per call, got {len(ts)}")
    if exactly == 1:    # the latency path: one tensor, checked inline
        if _dense_cpu(ts[0]):
            return ts
    return [check_tensor(t, what) for t in ts]


def check_outputs(ts, what: str) -> list[torch.Tensor]:
    """``check_tensors`` for tensors that results are copied into."""
    return [check_writable(t, what) for t in check_tensors(ts, what)]


def device_of(ts, what: str) -> torch.device:
    """The one device every tensor of a call lives on (CPU, or one CUDA device)."""
    devices = {t.device for t in ts}
    if len(devices) != 1:
        raise ValueError(f"{what}: tensors of one call must all live on one device, got "
                         f"{sorted(map(str, devices))}")
    return next(iter(devices))


def same_dtype(ts: list[torch.Tensor], what: str) -> torch.dtype | None:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise TypeError(f"{what}: tensors must share one dtype, got {sorted(map(str, dtypes))}")
    return ts[0].dtype if ts else None


def check_parts(parts, ref: torch.Tensor, what: str) -> None:
    """Every tensor of a list-form input or output is shaped like the one tensor on the other side."""
    for p in parts:
        if p.dtype != ref.dtype:
            raise TypeError(f"{what}: dtype {p.dtype} does not match {ref.dtype}")
        if p.numel() != ref.numel():
            raise ValueError(f"{what}: tensor of {p.numel()} elements where {ref.numel()} were expected")


def check_root(root: int, world: int, what: str) -> int:
    if not 0 <= root < world:
        raise ValueError(f"{what}: root rank {root} is out of range for a group of size {world}")
    return root


def check_peer(peer, rank: int, world: int, op: str) -> int:
    if not isinstance(peer, int) or not 0 <= peer < world:
        raise ValueError(f"{op}: peer rank {peer} is out of range for a group of size {world}")
    if peer == rank:
        raise ValueError(f"{op}: rank {peer} cannot {op} to itself")
    return peer


def split_counts(t: torch.Tensor, splits, world: int, what: str) -> tuple[int, ...]:
    """Element counts of ``all_to_all_single``'s blocks, from the split sizes along dim 0."""
    if t.dim() == 0:
        raise ValueError(f"all_to_all_single: {what} must have at least one dimension")
    row = t.numel() // t.size(0) if t.size(0) else 0
    if not splits:
        if t.size(0) % world:
            raise ValueError(f"all_to_all_single: {what} dim 0 ({t.size(0)}) is not divisible by the "
                             f"world size {world}; pass split sizes")
        return (t.size(0) // world * row,) * world
    splits = list(splits)
    if len(splits) != world or any(s < 0 for s in splits):
        raise ValueError(f"all_to_all_single: {what} split sizes must be {world} non-negative ints")
    if sum(splits) != t.size(0):
        raise ValueError(f"all_to_all_single: {what} split sizes sum to {sum(splits)} but dim 0 is {t.size(0)}")
    return tuple(s * row for s in splits)


def check_own_block(send_counts, recv_counts, rank: int, op: str) -> None:
    """The block a rank sends itself is the one it receives from itself."""
    if send_counts[rank] != recv_counts[rank]:
        raise ValueError(f"{op}: rank {rank} sends {send_counts[rank]} elements to itself but expects "
                         f"{recv_counts[rank]} from itself")


def no_write_back() -> None:
    """The write-back of a tensor that ``flat`` or ``flat_out`` did not copy."""


def check_writable(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` can receive a result: no two of its elements share memory (an expanded view
    would make the write-back fail after the communication, breaking the group)."""
    if not t.is_contiguous() and has_internal_overlap(t) == 1:
        raise ValueError(f"{what}: the tensor has elements that share memory (an expanded or "
                         f"stride-0 view), so results cannot be written into it; pass a tensor "
                         f"that owns its elements, e.g. t.clone()")
    return t


def _plain(t: torch.Tensor) -> bool:
    """Its memory holds its values as they read: contiguous, and no lazy negation or
    conjugation bit (``torch._neg_view``, ``.conj()``) that raw bytes would lose."""
    return t.is_contiguous() and not (t.is_neg() or t.is_conj())


def flat_in(t: torch.Tensor) -> torch.Tensor:
    """A flat contiguous tensor of ``t``'s values, for an input that is only read."""
    if _plain(t):
        return t if t.dim() == 1 else t.view(-1)
    return t.resolve_conj().resolve_neg().reshape(-1).contiguous()


def flat(t: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[], None]]:
    """A flat contiguous tensor holding ``t``'s values, and a write-back for in-place results."""
    if _plain(t):
        return (t if t.dim() == 1 else t.view(-1)), no_write_back
    check_writable(t, what)
    work = t.resolve_conj().resolve_neg().contiguous().view(-1)
    return work, lambda: t.copy_(work.view_as(t))


def flat_out(t: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[], None]]:
    """Like ``flat`` for an output-only tensor: no copy of the old contents is needed."""
    if _plain(t):
        return (t if t.dim() == 1 else t.view(-1)), no_write_back
    check_writable(t, what)
    work = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    return work, lambda: t.copy_(work.view(t.shape))


def cat(ts: list[torch.Tensor], dtype: torch.dtype | None, device) -> torch.Tensor:
    """The flat concatenation of ``ts`` (values resolved), or an empty tensor for none."""
    if not ts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1) for t in ts])


def unflatten_into(buf: torch.Tensor, tensors) -> None:
    """Copy consecutive ranges of the flat ``buf`` into ``tensors``, in order (list-form outputs)."""
    off = 0
    for t in tensors:
        t.copy_(buf[off:off + t.numel()].view_as(t))
        off += t.numel()
