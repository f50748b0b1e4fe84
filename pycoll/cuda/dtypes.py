"""torch dtype and reduce op -> NCCL data type and op, as a pure table (no cupy needed).

The numbers are NCCL's own enum values (nccl.h, stable since NCCL 2.0; bfloat16 since 2.10,
ncclAvg since 2.10), so the table is testable without cupy; at run time ``nccl.py`` checks them
against the constants cupy exposes where it has them.

Rules, as torch's ProcessGroupNCCL applies them:
- data movement (broadcast, all_gather, all_to_all, gather, scatter, send/recv) moves bytes:
  every dtype travels as uint8, so no dtype is refused there;
- bool reduces as uint8: SUM and MAX are logical or (NCCL max), PRODUCT and MIN logical and
  (NCCL min), as gloo and pycoll's CPU path do for bool;
- complex reduces as its float view (twice the elements) for SUM, AVG and PREMUL_SUM only;
- AVG: ncclAvg for floating types when NCCL >= 2.10, else SUM then divide (integers: truncating,
  as the CPU path); PREMUL_SUM: the local input is scaled on the stream, then SUM;
- int16 and the bitwise ops have no NCCL reduction: refused before any communication, with a
  message that points at ``PYCOLL_CUDA_PATH=ipc|staging``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ncclDataType_t
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
# ncclRedOp_t
SUM, PROD, MAX, MIN, AVG = range(5)

NAMES = {INT8: "ncclInt8", UINT8: "ncclUint8", INT32: "ncclInt32", UINT32: "ncclUint32",
         INT64: "ncclInt64", UINT64: "ncclUint64", FLOAT16: "ncclFloat16", FLOAT32: "ncclFloat32",
         FLOAT64: "ncclFloat64", BFLOAT16: "ncclBfloat16"}
OP_NAMES = {SUM: "ncclSum", PROD: "ncclProd", MAX: "ncclMax", MIN: "ncclMin", AVG: "ncclAvg"}

DTYPES = {
    torch.int8: INT8,
    torch.uint8: UINT8,
    torch.bool: UINT8,
    torch.int32: INT32,
    torch.int64: INT64,
    torch.float16: FLOAT16,
    torch.bfloat16: BFLOAT16,
    torch.float32: FLOAT32,
    torch.float64: FLOAT64,
    torch.complex64: FLOAT32,    # as its float view, twice the elements
    torch.complex128: FLOAT64,
}
COMPLEX = (torch.complex64, torch.complex128)
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_OPS = {"sum": SUM, "avg": SUM, "premul_sum": SUM, "product": PROD, "min": MIN, "max": MAX}
_BOOL_OPS = {"sum": MAX, "max": MAX, "bor": MAX, "product": MIN, "min": MIN, "band": MIN}
_COMPLEX_OPS = ("sum", "avg", "premul_sum")

NCCL_VERSION_BF16_AVG = 21000  # ncclBfloat16 and ncclAvg appeared in NCCL 2.10.0


class NcclUnsupported(ValueError):
    """This (dtype, op) has no NCCL reduction; raised before any communication."""


@dataclass(frozen=True)
class NcclReduction:
    """How to run one reduction through NCCL."""

    datatype: int        # ncclDataType_t
    op: int              # ncclRedOp_t
    as_real: bool        # reduce a complex tensor through its float view
    divide: bool         # AVG done as SUM: divide afterwards (Reduction.finish)


def nccl_reduction(dtype: torch.dtype, op_name: str, nccl_version: int) -> NcclReduction:
    """The NCCL data type and op for reducing ``dtype`` with ``op_name`` (reduce_ops.op_name)."""
    if dtype not in DTYPES:
        raise NcclUnsupported(f"NCCL has no reduction for dtype {dtype}; set PYCOLL_CUDA_PATH=ipc "
                              f"(one host) or staging")
    if dtype is torch.bfloat16 and nccl_version < NCCL_VERSION_BF16_AVG:
        raise NcclUnsupported(f"bfloat16 reductions need NCCL >= 2.10 (this is {fmt_version(nccl_version)})")
    if dtype is torch.bool:
        if op_name not in _BOOL_OPS:
            raise NcclUnsupported(f"ReduceOp.{op_name.upper()} is not defined for bool tensors on NCCL")
        return NcclReduction(UINT8, _BOOL_OPS[op_name], False, False)
    if dtype in COMPLEX and op_name not in _COMPLEX_OPS:
        raise NcclUnsupported(f"ReduceOp.{op_name.upper()} is not defined for complex tensors")
    if op_name not in _OPS:
        raise NcclUnsupported(f"ReduceOp.{op_name.upper()} has no NCCL equivalent (NCCL reduces with "
                              f"sum, prod, min, max, avg); set PYCOLL_CUDA_PATH=ipc or staging")
    if op_name == "avg" and dtype in FLOATING and nccl_version >= NCCL_VERSION_BF16_AVG:
        return NcclReduction(DTYPES[dtype], AVG, False, False)
    return NcclReduction(DTYPES[dtype], _OPS[op_name], dtype in COMPLEX, op_name == "avg")


def fmt_version(code: int) -> str:
    """NCCL's version code as text: 21903 -> '2.19.3' (codes >= 2.9 are X*10000 + Y*100 + Z)."""
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def check_cupy_constants(nccl_module) -> None:
    """Raise if cupy's constants disagree with this table (a changed cupy or NCCL enum)."""
    for name, value in (*_CUPY_DTYPES.items(), *_CUPY_OPS.items()):
        have = getattr(nccl_module, name, None)
        if have is not None and int(have) != value:
            raise RuntimeError(f"cupy.cuda.nccl.{name} is {have}, pycoll expects {value}")


_CUPY_DTYPES = {"NCCL_INT8": INT8, "NCCL_UINT8": UINT8, "NCCL_INT32": INT32, "NCCL_UINT32": UINT32,
                "NCCL_INT64": INT64, "NCCL_UINT64": UINT64, "NCCL_FLOAT16": FLOAT16, "NCCL_FLOAT32": FLOAT32,
                "NCCL_FLOAT64": FLOAT64, "NCCL_BFLOAT16": BFLOAT16}
_CUPY_OPS = {"NCCL_SUM": SUM, "NCCL_PROD": PROD, "NCCL_MAX": MAX, "NCCL_MIN": MIN, "NCCL_AVG": AVG}
