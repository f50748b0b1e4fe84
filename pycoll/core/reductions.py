"""Reduction kernels: in-place, vectorised torch ops, chosen once per collective.

Each kernel is ``kernel(dst, src)`` meaning ``dst = dst op src`` on equal-length 1-D tensors;
torch runs these in C++ without the GIL, so the hot path does no per-element Python work.
``ReduceOp.AVG`` reduces as SUM and divides at the end; ``PREMUL_SUM`` multiplies the local
contribution by its factor first. Unsupported (op, dtype) pairs raise ValueError up front,
before any communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from pycoll.core import kernels

INTEGER = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
FLOATING = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
COMPLEX = {torch.complex64, torch.complex128}
SUPPORTED_DTYPES = INTEGER | FLOATING | COMPLEX | {torch.bool}

Kernel = Callable[[torch.Tensor, torch.Tensor], None]


def _sum(d, s):
    d.add_(s)


def _prod(d, s):
    d.mul_(s)


def _min(d, s):
    torch.minimum(d, s, out=d)


def _max(d, s):
    torch.maximum(d, s, out=d)


def _band(d, s):
    d.bitwise_and_(s)


def _bor(d, s):
    d.bitwise_or_(s)


def _bxor(d, s):
    d.bitwise_xor_(s)


# bool: SUM saturates (logical or) and PRODUCT is logical and, as Gloo does for bool.
_BOOL = {"sum": _bor, "product": _band, "min": _band, "max": _bor,
         "band": _band, "bor": _bor, "bxor": _bxor}
_ARITH = {"sum": _sum, "product": _prod, "avg": _sum, "premul_sum": _sum}
_ORDERED = {"min": _min, "max": _max}
_INT_ARITH = {"sum": _sum, "product": _prod, "avg": _sum}
_BITWISE = {"band": _band, "bor": _bor, "bxor": _bxor}


_OUT_OF_PLACE = {_sum: torch.add, _prod: torch.mul, _min: torch.minimum, _max: torch.maximum,
                 _band: torch.bitwise_and, _bor: torch.bitwise_or, _bxor: torch.bitwise_xor}
_NP = {"sum": np.add, "avg": np.add, "premul_sum": np.add, "product": np.multiply, "min": np.minimum,
       "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
_NP_BOOL = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or, "product": np.logical_and,
            "min": np.logical_and, "band": np.logical_and, "bxor": np.logical_xor}


# Float overflow in a numpy reduction must give inf without a RuntimeWarning, as torch (and
# so gloo) does. np.errstate costs a microsecond per small all_reduce; numpy 2 keeps the error
# state in a context variable, set here directly (through np.errstate where it does not).
try:
    from numpy._core._ufunc_config import _extobj_contextvar as _FP_STATE
    from numpy._core._ufunc_config import _make_extobj
    _FP_QUIET = _make_extobj(all="ignore")

    def _quietly(ufunc, a, b, out) -> None:
        token = _FP_STATE.set(_FP_QUIET)
        try:
            ufunc(a, b, out=out)
        finally:
            _FP_STATE.reset(token)
except (ImportError, TypeError):   # pragma: no cover - numpy < 2
    def _quietly(ufunc, a, b, out) -> None:
        with np.errstate(all="ignore"):
            ufunc(a, b, out=out)


@dataclass(frozen=True)
class Reduction:
    """A reduce op bound to a dtype and world size: the kernel plus pre/post scaling."""

    name: str
    kernel: Kernel
    factor: float | None = None  # PREMUL_SUM factor applied to local input
    divisor: int = 1             # AVG: divide the result by the world size
    ufunc: Callable | None = None  # the same op as a numpy ufunc (small messages), if numpy has the dtype
    numpy_loops: bool = False      # large tensors reduce in numpy (pycoll/core/kernels.py says why)

    def reduce(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst = dst op src`` on flat tensors, off torch's intra-op pool (pycoll/core/kernels.py)."""
        self.combine(dst, src, dst)

    def combine(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """``out = a op b`` in one pass (saves the copy of ``out = a; out op= b``)."""
        if out.numel() < kernels.GRAIN:
            _OUT_OF_PLACE[self.kernel](a, b, out=out)
        elif self.numpy_loops:
            self.np_combine(kernels.as_numpy(a), kernels.as_numpy(b), kernels.as_numpy(out))
        else:
            op = _OUT_OF_PLACE[self.kernel]
            kernels.sliced(lambda x, y, z: op(x, y, out=z), a, b, out)

    def np_combine(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """``out = a op b`` on numpy arrays (``ufunc`` must be set); float overflow gives inf
        without numpy's warning, as in torch."""
        _quietly(self.ufunc, a, b, out)

    def prepare(self, t: torch.Tensor) -> None:
        """Scale a working copy of the local contribution in place (PREMUL_SUM)."""
        if self.factor is not None:
            kernels.sliced(lambda x: x.mul_(self.factor), t)

    def finish(self, t: torch.Tensor) -> None:
        """Turn the reduced sum into the op's result in place (AVG)."""
        if self.divisor != 1:
            if t.is_floating_point() or t.is_complex():
                kernels.sliced(lambda x: x.div_(self.divisor), t)
            else:
                kernels.sliced(lambda x: x.copy_(torch.div(x, self.divisor, rounding_mode="trunc")), t)


def op_name(op) -> str:
    """Normalise a c10d ReduceOp (or RedOpType, or string) to a lower-case name."""
    if isinstance(op, str):
        return op.lower()
    inner = getattr(op, "op", None)
    target = inner if inner is not None else op
    return str(getattr(target, "name", target)).split(".")[-1].lower()


def op_factor(op) -> float | None:
    """The PREMUL_SUM factor carried by a c10d ReduceOp, as a Python float."""
    f = getattr(op, "factor", None) if not isinstance(op, str) else None
    if f is None:
        return None
    if isinstance(f, torch.Tensor):
        if f.numel() != 1:
            raise ValueError("PREMUL_SUM factor must be a scalar")
        return f.item()
    return float(f)


_CACHE: dict = {}
_SUM = dist.ReduceOp.SUM
_SUM_KEY = int(_SUM)   # the key the general path below makes for SUM


def make_reduction(op, dtype: torch.dtype, world_size: int) -> Reduction:
    """Bind ``op`` to ``dtype``; raises ValueError if the op is undefined for the dtype.

    Reductions without a factor are cached: this runs on every call's latency path.
    """
    if type(op) is dist.ReduceOp and op == _SUM:
        # c10d's common case, in one comparison: reading .op off a ReduceOp and turning the
        # pybind enum into something hashable costs 0.8 us on every call
        key = (_SUM_KEY, dtype, world_size)
    else:
        inner = op.op if type(op) is dist.ReduceOp else op
        key = (int(inner) if isinstance(inner, dist.ReduceOp.RedOpType) else inner, dtype, world_size)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    red = _make_reduction(op, dtype, world_size)
    if red.factor is None:
        _CACHE[key] = red
    return red


def _make_reduction(op, dtype: torch.dtype, world_size: int) -> Reduction:
    name = op_name(op)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"pycoll does not support dtype {dtype}")
    if dtype is torch.bool:
        table = _BOOL
    elif dtype in COMPLEX:
        table = _ARITH
    elif dtype in FLOATING:
        table = {**_ARITH, **_ORDERED}
    else:
        # No premul_sum: a float factor cannot scale an integer tensor in place, and failing
        # inside the task would consume a sequence number on this rank only.
        table = {**_INT_ARITH, **_ORDERED, **_BITWISE}
    if name not in table:
        raise ValueError(f"ReduceOp.{name.upper()} is not defined for dtype {dtype}")
    factor = op_factor(op) if name == "premul_sum" else None
    if name == "premul_sum" and factor is None:
        raise ValueError("ReduceOp.PREMUL_SUM needs a factor (torch.distributed._make_nccl_premul_sum)")
    ufunc = None if dtype is torch.bfloat16 else (_NP_BOOL if dtype is torch.bool else _NP)[name]
    return Reduction(name, table[name], factor, world_size if name == "avg" else 1, ufunc,
                     numpy_loops=ufunc is not None and dtype in kernels.NUMPY_LOOPS)
