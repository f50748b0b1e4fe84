"""Argument checks that run before any communication, with gloo's exception types or clearer.

Also the reshaping every collective needs: a flat contiguous view of a tensor, or, for a
non-contiguous tensor, a contiguous copy plus the function that writes results back (gloo
rejects such tensors; handling them costs one copy and no surprise).
"""

from __future__ import annotations

from typing import Callable

import torch

from pycoll.core.reductions import SUPPORTED_DTYPES
from pycoll.torch_compat import has_internal_overlap

_STRIDED = torch.strided
CUDA_HINT = ("CUDA tensors need pycoll's CUDA support: install the extra with "
             "`pip install pycoll[cuda]` (CuPy)")


def cuda_tensor_message(what: str) -> str:
    """Why a CPU-path check met a CUDA tensor: CUDA calls go through pycoll.cuda (docs/cuda.md).

    ProcessGroupPycoll routes calls with CUDA tensors to pycoll.cuda before this check runs, so
    this is reached only by a direct call of a CPU method; it names the paths and the extra.
    """
    from pycoll.cuda.paths import ENV, EXTRA

    return (f"{what}: CUDA tensor given to pycoll's CPU path. Through the process group, CUDA "
            f"tensors take {ENV}=auto|nccl|ipc|staging (docs/cuda.md); the nccl path needs "
            f"CuPy: install the extra with `{EXTRA}`")


def check_dense(t, what: str, device: str) -> torch.Tensor:
    """A dense tensor of a supported dtype on ``device`` ("cpu" or "cuda"), or a clear error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{what}: {t.layout} tensors are not supported (only dense, strided tensors)")
    if t.device.type != device:
        if t.device.type == "cuda":
            raise RuntimeError(cuda_tensor_message(what))
        raise ValueError(f"{what}: tensors on device {t.device} are not supported here ({device} only)")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {t.dtype} is not supported")
    return t


def check_tensor(t, what: str) -> torch.Tensor:
    return check_dense(t, what, "cpu")


def check_tensors(ts, what: str, exactly: int | None = None) -> list[torch.Tensor]:
    ts = list(ts)
    if exactly is not None and len(ts) != exactly:
        raise ValueError(f"{what}: expected {exactly} tensor(s) per call, got {len(ts)}")
    if exactly == 1:    # the latency path: one tensor, checked inline
        t = ts[0]
        if (isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.is_cpu
                and t.dtype in SUPPORTED_DTYPES):
            return ts
    return [check_tensor(t, what) for t in ts]


def check_outputs(ts, what: str) -> list[torch.Tensor]:
    """``check_tensors`` for tensors that results are copied into."""
    return [check_writable(t, what) for t in check_tensors(ts, what)]


def same_dtype(ts: list[torch.Tensor], what: str) -> torch.dtype | None:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise TypeError(f"{what}: tensors must share one dtype, got {sorted(map(str, dtypes))}")
    return ts[0].dtype if ts else None


def check_root(root: int, world: int, what: str) -> int:
    if not 0 <= root < world:
        raise ValueError(f"{what}: root rank {root} is out of range for a group of size {world}")
    return root


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
    work = torch.empty(t.numel(), dtype=t.dtype)
    return work, lambda: t.copy_(work.view(t.shape))


def unflatten_into(buf: torch.Tensor, tensors) -> None:
    """Copy consecutive ranges of the flat ``buf`` into ``tensors``, in order (list-form outputs)."""
    off = 0
    for t in tensors:
        t.copy_(buf[off:off + t.numel()].view_as(t))
        off += t.numel()
