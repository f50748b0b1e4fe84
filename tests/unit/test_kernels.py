"""The data path's copies and reductions (pycoll/core/kernels.py, Reduction.reduce/combine): equal
to torch's own ops for every dtype and op, below and above the size where they leave torch;
and the spin rule of shared-memory barriers."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from pycoll.core import kernels
from pycoll.core.reductions import make_reduction

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
OPS = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
       "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
SIZES = [0, 1, kernels.GRAIN - 1, kernels.GRAIN, 2 * kernels.GRAIN + 5]


def _data(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 1e3
        x[::97] = float("inf")      # overflow, inf and nan go through quietly, as in torch
        x[::89] = float("nan")
        return x.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_copy_equals_torch_copy(dtype, n):
    src = _data(n, dtype, 1)
    dst = torch.nn.Parameter(torch.zeros(n, dtype=dtype), requires_grad=dtype.is_floating_point)
    with torch.no_grad():    # as on the data path (reductions run on tensors that need no grad)
        kernels.copy(dst, src)
    assert torch.equal(dst.detach().view(torch.uint8), src.view(torch.uint8))


@pytest.mark.filterwarnings("error")     # numpy must not warn where torch does not
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_and_combine_equal_torch(dtype, n):
    for name, fn in OPS.items():
        try:
            red = make_reduction(getattr(dist.ReduceOp, name), dtype, 2)
        except ValueError:
            continue       # undefined for the dtype, refused before any communication
        a, b = _data(n, dtype, 2), _data(n, dtype, 3)
        if dtype is torch.bool:
            fn = {"SUM": torch.logical_or, "PRODUCT": torch.logical_and, "MIN": torch.logical_and,
                  "MAX": torch.logical_or}.get(name, fn)
        want = fn(a, b)
        out = torch.empty_like(a)
        red.combine(a, b, out)
        got = a.clone()
        red.reduce(got, b)
        for res in (out, got):
            same = torch.equal(res, want) if not (dtype.is_floating_point or dtype.is_complex) else \
                torch.equal(res.isnan(), want.isnan()) and torch.equal(res.nan_to_num(), want.nan_to_num())
            assert same, (name, dtype, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_avg_and_premul_on_large_tensors(dtype):
    n = 2 * kernels.GRAIN + 5
    x = (torch.arange(n) % 1000).to(dtype)
    red = make_reduction(dist.ReduceOp.AVG, dtype, 3)
    got = x.clone()
    red.finish(got)
    want = x / 3 if dtype.is_floating_point else torch.div(x, 3, rounding_mode="trunc")
    assert torch.equal(got, want.to(dtype))
    if dtype.is_floating_point:
        red = make_reduction(dist._make_nccl_premul_sum(1.5), dtype, 3)
        got = x.clone()
        red.prepare(got)
        assert torch.equal(got, x * 1.5)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d is not torch.bfloat16])  # (numpy has none)
def test_numpy_at_is_the_tensors_own_memory(dtype):
    base = _data(9, dtype, 3)
    t = base[2:7]                     # an offset into a storage: the address says where
    view = kernels.numpy_at(t)
    assert torch.equal(torch.from_numpy(view.copy()), t)
    view[0] = view[4]                 # writes land in the tensor
    assert torch.equal(t[0], t[4]) and torch.equal(base[2], base[6])
    if not dtype.is_complex:
        assert kernels.numpy_at(t) is view    # made once per (address, size, dtype)
    assert kernels.numpy_at(base[2:6]).shape == (4,)   # same address, other size: its own view


def test_numpy_at_needs_no_grad_mode_and_stays_bounded():
    p = torch.nn.Parameter(torch.ones(3))
    kernels.numpy_at(p)[:] = 2        # a leaf that requires grad, as in dist.all_reduce(param)
    assert torch.equal(p.detach(), torch.full((3,), 2.0))
    keep = [torch.ones(i + 1) for i in range(3 * kernels._VIEWS_MAX)]
    for x in keep:
        kernels.numpy_at(x)
    assert len(kernels._VIEWS) <= kernels._VIEWS_MAX
    assert kernels.numpy_at(torch.empty(0)).shape == (0,)
