"""The data path's copies and elementwise loops, kept off torch's intra-op thread pool.

torch runs an op over more than ``GRAIN`` elements on its intra-op pool (OpenMP, one thread
per core by default). The ranks of one host already occupy its cores, so a collective that
forks that pool fights its own peers for them: libgomp's threads spin for a while after every
parallel op, on the cores the peers need. Measured here, 2 ranks on 2 cores with torch's
default 2 threads each: a 1 MiB all_reduce took 32 ms through shared memory (gloo 3.7 ms);
with OMP_NUM_THREADS=1, which torchrun sets and mp.spawn does not, 0.17 ms.

So the data path never forks it: large copies and reductions run in numpy (single-threaded,
without the GIL, as fast per core), and what numpy does slowly or not at all (float16,
bfloat16, complex) runs in torch in slices under ``GRAIN`` elements, which torch runs inline.
Small tensors take torch directly: below ``GRAIN`` it never forks, and its call costs less
than three numpy views.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import torch

GRAIN = 32768   # at::internal::GRAIN_SIZE: torch runs smaller ops in the calling thread

NUMPY_LOOPS = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                         torch.float32, torch.float64})


_VIEWS: dict = {}   # (address, numel, dtype) -> numpy array over that memory, not owning it
_VIEWS_MAX = 64


def numpy_at(t: torch.Tensor) -> np.ndarray:
    """``t.numpy()`` for a contiguous CPU tensor of a real dtype, cached by address: the
    small all_reduce makes one every call, and ``t.numpy()`` costs 0.7 us there.

    An entry is an array over raw memory that keeps nothing alive; it is handed out only
    for a tensor that holds that very memory now (same address, size and dtype), so an
    entry left by a freed tensor is never read. (Complex tensors take ``t.numpy()``: it
    refuses the conjugate-bit views that an address says nothing about.)"""
    key = (t.data_ptr(), t.numel(), t.dtype)
    view = _VIEWS.get(key)
    if view is None:
        np_dtype = NP_DTYPES.get(t.dtype)
        if np_dtype is None or not key[1]:
            return t.numpy()
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        raw = (ctypes.c_char * t.nbytes).from_address(key[0])
        view = _VIEWS[key] = np.frombuffer(raw, dtype=np_dtype)
    return view


NP_DTYPES = {dt: torch.empty(0, dtype=dt).numpy().dtype for dt in NUMPY_LOOPS | {torch.float16}}
NUMPY_VIEWABLE = frozenset(NP_DTYPES)   # the dtypes numpy_at views by address


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a flat CPU tensor (which may require grad: results are written in place)."""
    return t.detach().numpy()


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for flat contiguous tensors of one dtype and size."""
    if dst.numel() < GRAIN:
        dst.copy_(src)
    else:
        np.copyto(as_numpy(dst.view(torch.uint8)), as_numpy(src.view(torch.uint8)))


def sliced(fn: Callable[..., None], *ts: torch.Tensor) -> None:
    """``fn(*ts)`` on consecutive slices of under ``GRAIN`` elements of equal-size flat tensors."""
    n = ts[0].numel()
    if n < GRAIN:
        fn(*ts)
        return
    for lo in range(0, n, GRAIN):
        fn(*(t[lo:lo + GRAIN] for t in ts))
