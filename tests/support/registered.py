"""Registered shared memory in the tests: inputs and reference per dtype and op, and the
counts of the heap's mappings and descriptors in this process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pycoll.testing.ranks import memfd_fds, memfd_maps
from pycoll.testing.reference import reference


def _inputs(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype is torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(n, generator=g, dtype=torch.float64)
        if op == "product":
            x = 1 + x / 8          # keep products of 4 ranks in range
        if dtype.is_complex:
            x = torch.complex(x, torch.randn(n, generator=g, dtype=torch.float64))
        return x.to(dtype)
    hi = 3 if op == "product" else 100
    lo = 0 if dtype is torch.uint8 else -hi
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reference(world: int, n: int, dtype, op: str) -> torch.Tensor:
    return reference(op, (_inputs(r, n, dtype, op) for r in range(world)), factor=0.5)


def _redop(op: str, dtype):
    if op == "premul_sum":
        return dist._make_nccl_premul_sum(0.5)
    return getattr(dist.ReduceOp, op.upper())


DTYPE_OPS = [
    (torch.float32, ["sum", "product", "min", "max", "avg", "premul_sum"]),
    (torch.float64, ["sum", "avg"]),
    (torch.float16, ["sum", "max"]),
    (torch.bfloat16, ["sum", "min"]),
    (torch.complex64, ["sum", "avg"]),
    (torch.int32, ["sum", "product", "min", "max", "band", "bor", "bxor", "avg"]),
    (torch.int64, ["sum", "bxor"]),
    (torch.int8, ["max"]),
    (torch.int16, ["sum"]),
    (torch.uint8, ["bor", "sum"]),
    (torch.bool, ["sum", "product", "bxor"]),
]


def _heap_maps() -> int:
    return len(memfd_maps("pycoll-heap"))


def _heap_fds() -> int:
    return len(memfd_fds("pycoll-heap"))


def _heap_rss() -> int:
    """Bytes of the group's heap mappings resident in this process (its own pages and the
    peers' it has touched), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not line[0].isupper():            # a mapping's header line
                inside = "pycoll-heap" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total
