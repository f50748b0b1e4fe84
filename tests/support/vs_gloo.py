"""pycoll against gloo on identical seeded inputs: inputs, the whole-world reference with its
error bounds, the checker, and the rank functions that cover every collective (an area).
Used by tests/ranks/test_vs_gloo.py and tests/ranks/test_c10d_surface.py.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from pycoll.testing.reference import reference as whole_world

R = dist.ReduceOp


BOOL = torch.bool


INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


COMPLEX = [torch.complex64, torch.complex128]


DTYPES = [BOOL, *INTS, *FLOATS, *COMPLEX]


OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]


PREMUL_FACTOR = 1.5


BIG = 70_001          # crosses the all_reduce / all_gather / broadcast size thresholds


# at BIG, reductions leave torch for numpy (or slices): pycoll/core/kernels.py
BIG_OPS = ("SUM", "MAX", "BXOR", "AVG", "PREMUL_SUM")


MAX_REPORT = 40       # mismatches listed per rank


# "auto" takes shared memory when all ranks share a host (as here); "tcp" forces sockets
TRANSPORTS = ["tcp", "auto"]


def defined(op: str, dtype: torch.dtype) -> bool:
    """Whether (op, dtype) is a defined reduction (torch itself refuses complex MIN etc.)."""
    if dtype is BOOL:
        return op not in ("AVG", "PREMUL_SUM")
    if dtype in INTS:
        return op != "PREMUL_SUM"
    if dtype in FLOATS:
        return op not in ("BAND", "BOR", "BXOR")
    return op in ("SUM", "AVG", "PREMUL_SUM")


def reduce_op(op: str, factor=PREMUL_FACTOR):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(R, op)


def seed_of(*parts: int) -> int:
    return functools.reduce(lambda a, b: (a * 1_000_003 + b) % (1 << 62), parts, 7)


def gen(dtype: torch.dtype, n, seed: int, op: str = "") -> torch.Tensor:
    """Seeded input: full-range bits for integer ops that wrap exactly, small values where a
    sum or product must not overflow (AVG) or should stay informative (PRODUCT)."""
    g = torch.Generator().manual_seed(seed)
    shape = n if isinstance(n, tuple) else (n,)
    numel = math.prod(shape)
    if dtype is BOOL:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in INTS:
        if op in ("AVG", "PRODUCT"):
            lo = 0 if dtype is torch.uint8 else -4
            hi = (60 if dtype is torch.uint8 else 30) if op == "AVG" else 5
            return torch.randint(lo, hi, shape, generator=g).to(dtype)
        return torch.randint(0, 256, (numel * dtype.itemsize,), generator=g,
                             dtype=torch.uint8).view(dtype).view(shape)
    real = torch.float64
    if dtype in COMPLEX:
        x = torch.complex(torch.randn(shape, generator=g, dtype=real),
                          torch.randn(shape, generator=g, dtype=real))
        return x.to(dtype)
    if op == "PRODUCT":
        mag = 0.5 + torch.rand(shape, generator=g, dtype=real)
        sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
        return (mag * sign).to(dtype)
    return torch.randn(shape, generator=g, dtype=real).to(dtype)


def reference(xs: list[torch.Tensor], op: str, world: int):
    """(result, tolerance or None): the op over every rank's input, as a single process sees
    it (``pycoll.testing.reference``; floats reduced in float64 or complex128, then rounded
    once, with the error bound of any order of accumulation)."""
    dtype, name = xs[0].dtype, op.lower()
    if dtype is BOOL or op in ("MIN", "MAX"):
        return whole_world(name, xs), None
    if dtype in INTS:
        if op == "AVG":   # summed without wrapping, as the inputs are chosen for
            return whole_world(name, [x.long() for x in xs]).to(dtype), None
        return whole_world(name, xs), None  # integer arithmetic wraps alike in any order
    wide = torch.complex128 if dtype in COMPLEX else torch.float64
    ys = [x.to(wide) for x in xs]
    exact = whole_world(name, ys, factor=PREMUL_FACTOR)
    if op == "PRODUCT":
        mag = exact.abs()
    else:
        scale = PREMUL_FACTOR if op == "PREMUL_SUM" else 1
        mag = whole_world("avg" if op == "AVG" else "sum", [_abs(y) * scale for y in ys])
    return exact.to(dtype), bound(mag, exact, dtype, world)


def _abs(t: torch.Tensor) -> torch.Tensor:
    return t.abs() if not t.is_complex() else torch.view_as_real(t).abs().amax(-1) * 2


def bound(mag: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
    """Error bound of a result rounded at each of ``world`` accumulation steps (any order)
    plus the conversions: (world + 2) * eps * sum |x_i| elementwise, plus the smallest normal."""
    real = {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)
    fi = torch.finfo(real)
    return ((world + 2) * fi.eps * (mag.double() + _abs(exact).double()) + fi.tiny)


class Checker:
    def __init__(self, rank: int, world: int, label: str) -> None:
        self.rank, self.world, self.label = rank, world, label
        self.fails: list[str] = []
        self.checks = 0

    def fail(self, what: str, msg: str) -> None:
        self.fails.append(f"[{self.label} world={self.world} rank={self.rank}] {what}: {msg}")

    def same(self, what: str, got, exp, tol=None) -> None:
        """got == exp (nested lists of tensors); within ``tol`` (a tensor, elementwise) if given;
        ``tol="approx"``: floating point within a few ulps of the magnitude (small reductions)."""
        self.checks += 1
        if not isinstance(got, (list, tuple, torch.Tensor, type(None))):
            if got != exp:
                self.fail(what, f"{got!r} != {exp!r}")
            return
        if isinstance(exp, BaseException):
            self.fail(what, f"expected an error-free reference, got {exp!r}")
            return
        if isinstance(got, (list, tuple)) or isinstance(exp, (list, tuple)):
            if not isinstance(got, (list, tuple)) or not isinstance(exp, (list, tuple)) or len(got) != len(exp):
                self.fail(what, f"structure differs: {_shape(got)} vs {_shape(exp)}")
                return
            tols = tol if isinstance(tol, (list, tuple)) else [tol] * len(exp)
            for i, (g, e, t) in enumerate(zip(got, exp, tols)):
                self.same(f"{what}[{i}]", g, e, t)
            return
        if got is None or exp is None:
            if got is not exp:
                self.fail(what, f"{_shape(got)} vs {_shape(exp)}")
            return
        if got.dtype != exp.dtype or got.shape != exp.shape:
            self.fail(what, f"dtype/shape {got.dtype}{tuple(got.shape)} vs {exp.dtype}{tuple(exp.shape)}")
            return
        if isinstance(tol, str):
            if not (got.is_floating_point() or got.is_complex()):
                tol = None
            else:
                tol = bound(_abs(exp.to(torch.complex128 if exp.is_complex() else torch.float64)), exp, got.dtype,
                            4 * self.world)
        if tol is None:
            if not torch.equal(got, exp):
                self.fail(what, f"not equal, max abs diff {_maxdiff(got, exp)}, "
                                f"{int((got != exp).sum())} of {got.numel()} elements differ")
            return
        diff = _absdiff(got, exp)
        bad = diff > tol.reshape(diff.shape)
        if bad.any():
            i = int(bad.reshape(-1).nonzero()[0])
            self.fail(what, f"{int(bad.sum())} of {got.numel()} elements beyond tolerance, max abs diff "
                            f"{float(diff.max()):.3g}; first at {i}: {got.reshape(-1)[i].item()} vs "
                            f"{exp.reshape(-1)[i].item()} (tol {float(tol.reshape(-1)[i]):.3g})")

    def raises(self, what: str, exc_types, fn) -> BaseException | None:
        self.checks += 1
        try:
            fn()
        except exc_types as exc:
            return exc
        except BaseException as exc:  # noqa: BLE001
            self.fail(what, f"raised {type(exc).__name__}: {exc}; expected {exc_types}")
            return exc
        self.fail(what, f"did not raise; expected {exc_types}")
        return None


def _shape(x):
    if isinstance(x, (list, tuple)):
        return [_shape(y) for y in x]
    if isinstance(x, torch.Tensor):
        return f"{x.dtype}{tuple(x.shape)}"
    return repr(x)


def _absdiff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_complex():
        return (torch.view_as_real(a.to(torch.complex128)) - torch.view_as_real(b.to(torch.complex128))).abs().amax(-1)
    if a.dtype is BOOL:
        return (a != b).double()
    return (a.double() - b.double()).abs()


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(_absdiff(a, b).max()) if a.numel() else 0.0


def both(fn):
    """fn(group) on pycoll (default group) and on gloo; gloo's refusal comes back as the exception."""
    p = fn(None)
    try:
        g = fn(GLOO[0])
    except (RuntimeError, ValueError, TypeError) as exc:
        g = exc
    return p, g


GLOO: list = [None]


def _tol2(tol):
    return None if tol is None else tol * 2


def check_pair(ck: Checker, what: str, p, g, ref, tol=None) -> None:
    """pycoll against the reference always, and against gloo where gloo supports the call."""
    ck.same(f"{what} pycoll vs reference", p, ref, tol)
    if not isinstance(g, BaseException):
        ck.same(f"{what} pycoll vs gloo", p, g, _tol2(tol) if not isinstance(tol, list) else [_tol2(t) for t in tol])
    else:
        ck.gloo_refused = getattr(ck, "gloo_refused", 0) + 1


def _all_reduce_area(ck: Checker, rank: int, world: int, sizes, dtypes, ops, big_dtypes) -> None:
    case = 0
    for dtype in dtypes:
        for op in ops:
            if not defined(op, dtype):
                continue
            for n in [*sizes, *([BIG] if dtype in big_dtypes and op in BIG_OPS else [])]:
                case += 1
                what = f"all_reduce {dtype} {op} n={n}"
                xs = [gen(dtype, n, seed_of(1, case, q), op) for q in range(world)]
                ref, tol = reference(xs, op, world)

                def run(group, n=n, dtype=dtype, op=op, case=case):
                    t = gen(dtype, n, seed_of(1, case, rank), op)
                    dist.all_reduce(t, op=reduce_op(op), group=group)
                    return t
                p, g = both(run)
                check_pair(ck, what, p, g, ref, tol)

            # reduce: roots cycle across (dtype, op); every root for the dtypes below
            roots = range(world) if dtype in (BOOL, torch.int64, torch.float32) else [case % world]
            for root in roots:
                case += 1
                n = 13
                what = f"reduce {dtype} {op} n={n} root={root}"
                xs = [gen(dtype, n, seed_of(2, case, q), op) for q in range(world)]
                ref, tol = reference(xs, op, world)

                def run(group, dtype=dtype, op=op, case=case, root=root):
                    t = gen(dtype, n, seed_of(2, case, rank), op)
                    dist.reduce(t, dst=root, op=reduce_op(op), group=group)
                    return t if rank == root else None   # gloo leaves scratch in non-root outputs
                p, g = both(run)
                check_pair(ck, what, p, g, ref if rank == root else None, tol)
                if rank != root and p is None:
                    # pycoll leaves non-root inputs untouched (even for PREMUL_SUM)
                    t = gen(dtype, n, seed_of(2, case, rank), op)
                    t0 = t.clone()
                    case += 1
                    dist.reduce(t, dst=root, op=reduce_op(op))
                    ck.same(f"{what} non-root input untouched", t, t0)
                elif rank == root:
                    case += 1
                    dist.reduce(gen(dtype, n, 0, op), dst=root, op=reduce_op(op))

            # reduce_scatter (list, uneven sizes where gloo refuses them) and reduce_scatter_tensor
            for form in ("list", "tensor", "uneven"):
                case += 1
                chunk = 13 if form != "uneven" else None
                counts = [chunk] * world if chunk else [q % 3 + 1 for q in range(world)]
                what = f"reduce_scatter_{form} {dtype} {op} counts={counts}"
                inputs = {q: [gen(dtype, counts[j], seed_of(3, case, q, j), op) for j in range(world)]
                          for q in range(world)}
                ref, tol = reference([inputs[q][rank] for q in range(world)], op, world)

                def run(group, dtype=dtype, op=op, case=case, form=form, counts=counts):
                    ins = [gen(dtype, counts[j], seed_of(3, case, rank, j), op) for j in range(world)]
                    out = torch.full((counts[rank],), 0, dtype=dtype)
                    if form == "tensor":
                        dist.reduce_scatter_tensor(out, torch.cat(ins), op=reduce_op(op), group=group)
                    else:
                        dist.reduce_scatter(out, ins, op=reduce_op(op), group=group)
                    return out
                p, g = both(run)
                check_pair(ck, what, p, g, ref, tol)

        # coalesced all_reduce: several tensors of one dtype, both spellings
        for op in ("SUM", "MAX", "BXOR"):
            if not defined(op, dtype):
                continue
            case += 1
            shapes = [(3,), (0,), (2, 5), (1,)]
            what = f"all_reduce_coalesced {dtype} {op}"
            refs = [reference([gen(dtype, s, seed_of(4, case, q, i), op) for q in range(world)], op, world)
                    for i, s in enumerate(shapes)]

            def run(group, dtype=dtype, op=op, case=case):
                ts = [gen(dtype, s, seed_of(4, case, rank, i), op) for i, s in enumerate(shapes)]
                dist.all_reduce_coalesced(ts, op=reduce_op(op), group=group)
                return ts
            p, g = both(run)
            check_pair(ck, what, p, g, [r for r, _ in refs], [t for _, t in refs])

            def run_cm(group, dtype=dtype, op=op, case=case):
                ts = [gen(dtype, s, seed_of(4, case, rank, i), op) for i, s in enumerate(shapes)]
                with dist._coalescing_manager(group=group, async_ops=True) as cm:
                    for t in ts:
                        dist.all_reduce(t, op=reduce_op(op), group=group)
                cm.wait()
                return ts
            p, g = both(run_cm)
            check_pair(ck, f"_coalescing_manager(all_reduce) {dtype} {op}", p, g,
                       [r for r, _ in refs], [t for _, t in refs])


def _movement_area(ck: Checker, rank: int, world: int, sizes, dtypes, big_dtypes) -> None:
    case = 0
    for dtype in dtypes:
        all_sizes = [*sizes, *([BIG] if dtype in big_dtypes else [])]
        for n in all_sizes:
            # broadcast from every root (cycled for the big size)
            for root in (range(world) if n != BIG else [world - 1]):
                case += 1

                def run(group, n=n, dtype=dtype, case=case, root=root):
                    t = gen(dtype, n, seed_of(5, case, rank))
                    dist.broadcast(t, src=root, group=group)
                    return t
                p, g = both(run)
                check_pair(ck, f"broadcast {dtype} n={n} root={root}", p, g, gen(dtype, n, seed_of(5, case, root)))

            xs = None
            case += 1
            xs = [gen(dtype, (n, 2) if n < 20 else n, seed_of(6, case, q)) for q in range(world)]

            def ag(group, n=n, dtype=dtype, case=case):
                x = gen(dtype, (n, 2) if n < 20 else n, seed_of(6, case, rank))
                outs = [torch.zeros_like(x) for _ in range(world)]
                dist.all_gather(outs, x, group=group)
                return outs
            p, g = both(ag)
            check_pair(ck, f"all_gather {dtype} n={n}", p, g, xs)

            def agt(group, n=n, dtype=dtype, case=case):
                x = gen(dtype, (n, 2) if n < 20 else n, seed_of(6, case, rank))
                out = torch.zeros((world * x.shape[0], *x.shape[1:]), dtype=dtype)
                dist.all_gather_into_tensor(out, x, group=group)
                return out
            p, g = both(agt)
            check_pair(ck, f"all_gather_into_tensor {dtype} n={n}", p, g, torch.cat(xs))

            def agt_cm(group, n=n, dtype=dtype, case=case):
                x = gen(dtype, (n, 2) if n < 20 else n, seed_of(6, case, rank))
                out1 = torch.zeros((world * x.shape[0], *x.shape[1:]), dtype=dtype)
                out2 = torch.zeros(world * 3, dtype=dtype)
                with dist._coalescing_manager(group=group, async_ops=True) as cm:
                    dist.all_gather_into_tensor(out1, x, group=group)
                    dist.all_gather_into_tensor(out2, gen(dtype, 3, seed_of(7, case, rank)), group=group)
                cm.wait()
                return [out1, out2]
            p, g = both(agt_cm)
            check_pair(ck, f"_coalescing_manager(all_gather_into_tensor) {dtype} n={n}", p, g,
                       [torch.cat(xs), torch.cat([gen(dtype, 3, seed_of(7, case, q)) for q in range(world)])])

            if n == BIG:
                continue
            # all_gather_coalesced: several tensors of different shapes per rank
            shapes = [(n,), (2, 3), (0,)]

            def agc(group, dtype=dtype, case=case, shapes=shapes):
                ins = [gen(dtype, s, seed_of(8, case, rank, i)) for i, s in enumerate(shapes)]
                outs = [[torch.zeros(s, dtype=dtype) for s in shapes] for _ in range(world)]
                dist.all_gather_coalesced(outs, ins, group=group)
                return outs
            p, g = both(agc)
            check_pair(ck, f"all_gather_coalesced {dtype} n={n}", p, g,
                       [[gen(dtype, s, seed_of(8, case, q, i)) for i, s in enumerate(shapes)] for q in range(world)])

            # gather and scatter from every root
            for root in range(world):
                case += 1

                def gather(group, n=n, dtype=dtype, case=case, root=root):
                    x = gen(dtype, n, seed_of(9, case, rank))
                    outs = [torch.zeros_like(x) for _ in range(world)] if rank == root else None
                    dist.gather(x, outs, dst=root, group=group)
                    return outs
                p, g = both(gather)
                check_pair(ck, f"gather {dtype} n={n} root={root}", p, g,
                           [gen(dtype, n, seed_of(9, case, q)) for q in range(world)] if rank == root else None)

                def scatter(group, n=n, dtype=dtype, case=case, root=root):
                    ins = [gen(dtype, n, seed_of(10, case, j)) for j in range(world)] if rank == root else None
                    out = torch.zeros(n, dtype=dtype)
                    dist.scatter(out, ins, src=root, group=group)
                    return out
                p, g = both(scatter)
                check_pair(ck, f"scatter {dtype} n={n} root={root}", p, g, gen(dtype, n, seed_of(10, case, rank)))

        # all_to_all with uneven splits (rows of 3 elements; some splits are 0)
        case += 1
        split = [[(q + 2 * j + case) % 3 for j in range(world)] for q in range(world)]

        def a2a_in(q, j, dtype=dtype, case=case, split=split):
            return gen(dtype, (split[q][j], 3), seed_of(11, case, q, j))

        def a2a_single(group, dtype=dtype, split=split, a2a_in=a2a_in):
            inp = torch.cat([a2a_in(rank, j) for j in range(world)])
            out = torch.zeros((sum(split[q][rank] for q in range(world)), 3), dtype=dtype)
            dist.all_to_all_single(out, inp, output_split_sizes=[split[q][rank] for q in range(world)],
                                   input_split_sizes=split[rank], group=group)
            return out
        p, g = both(a2a_single)
        check_pair(ck, f"all_to_all_single uneven {dtype}", p, g, torch.cat([a2a_in(q, rank) for q in range(world)]))

        def a2a_even(group, dtype=dtype, case=case):
            inp = gen(dtype, (world * 2, 3), seed_of(12, case, rank))
            out = torch.zeros_like(inp)
            dist.all_to_all_single(out, inp, group=group)
            return out
        p, g = both(a2a_even)
        check_pair(ck, f"all_to_all_single even {dtype}", p, g,
                   torch.cat([gen(dtype, (world * 2, 3), seed_of(12, case, q))[2 * rank:2 * rank + 2]
                              for q in range(world)]))

        def a2a_list(group, dtype=dtype, split=split, a2a_in=a2a_in):
            ins = [a2a_in(rank, j) for j in range(world)]
            outs = [torch.zeros((split[q][rank], 3), dtype=dtype) for q in range(world)]
            dist.all_to_all(outs, ins, group=group)
            return outs
        p, g = both(a2a_list)
        check_pair(ck, f"all_to_all list uneven {dtype}", p, g, [a2a_in(q, rank) for q in range(world)])

    p, g = both(lambda group: dist.barrier(group=group))
    ck.same("barrier", p, None)


def _undefined_ops(ck: Checker, rank: int, world: int) -> None:
    """Undefined (op, dtype) pairs raise ValueError on the calling rank alone, before any
    communication: only rank 0 makes the bad calls, then every rank runs a good all_reduce."""
    if rank == 0:
        for dtype in [*FLOATS, BOOL, *INTS]:
            for op in ("BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"):
                if defined(op, dtype):
                    continue
                exc = ck.raises(f"all_reduce {dtype} {op} undefined", ValueError,
                                lambda: dist.all_reduce(torch.ones(4, dtype=dtype), op=reduce_op(op)))
                if exc is not None and "not defined" not in str(exc) and "PREMUL" not in str(exc):
                    ck.fail(f"all_reduce {dtype} {op}", f"unclear error: {exc}")
                ck.raises(f"reduce_scatter_tensor {dtype} {op} undefined", ValueError,
                          lambda: dist.reduce_scatter_tensor(torch.ones(2, dtype=dtype),
                                                             torch.ones(2 * world, dtype=dtype), op=reduce_op(op)))
                ck.raises(f"reduce {dtype} {op} undefined", ValueError,
                          lambda: dist.reduce(torch.ones(4, dtype=dtype), dst=0, op=reduce_op(op)))
    t = torch.full((5,), rank + 1, dtype=torch.int64)
    dist.all_reduce(t)
    ck.same("all_reduce after rejected calls", t, torch.full((5,), world * (world + 1) // 2, dtype=torch.int64))


def _area(rank: int, world: int, area: str, full: bool) -> dict:
    GLOO[0] = dist.new_group(backend="gloo")
    ck = Checker(rank, world, area)
    sizes = [0, 1, 13]
    if area == "reductions":
        dtypes = DTYPES if full else [BOOL, torch.uint8, torch.int32, torch.bfloat16, torch.float32, torch.complex64]
        ops = OPS if full else ["SUM", "PRODUCT", "MAX", "BXOR", "AVG", "PREMUL_SUM"]
        big = [BOOL, torch.int32, torch.float16, torch.float32, torch.float64, torch.complex64] if full \
            else [torch.float32, torch.float16]
        _all_reduce_area(ck, rank, world, sizes, dtypes, ops, big)
        _undefined_ops(ck, rank, world)
    elif area == "movement":
        dtypes = DTYPES if full else [BOOL, torch.int16, torch.bfloat16, torch.float64]
        big = [torch.float32, torch.uint8] if full else [torch.float32]
        _movement_area(ck, rank, world, sizes, dtypes, big)
    else:
        raise ValueError(area)
    dist.destroy_process_group(GLOO[0])
    GLOO[0] = None
    return {"fails": ck.fails, "checks": ck.checks, "gloo_refused": getattr(ck, "gloo_refused", 0)}


def _assert_clean(results: list[dict]) -> None:
    fails = [f for r in results for f in r["fails"]]
    assert all(r["checks"] > 0 for r in results)
    if fails:
        shown = "\n".join(fails[:MAX_REPORT])
        more = f"\n... and {len(fails) - MAX_REPORT} more" if len(fails) > MAX_REPORT else ""
        pytest.fail(f"{len(fails)} mismatches:\n{shown}{more}", pytrace=False)
