"""The whole-world reference and a runner of any schedule on in-memory ranks.

``run_case(collective, algo, world, count, dtype, op, ...)`` builds every rank's schedule,
runs them on the in-memory transport (``pycoll.testing.memory``), one thread a rank, and
compares each rank's output with ``reference``: the collective computed directly from all
ranks' inputs, not with pycoll. Inputs (``make_input``) keep every reduction exact in its
dtype, so the comparison is bitwise. The algorithms' unit tests and the transport
conformance tests run on it; so can a new algorithm's.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

import torch

from pycoll import torch_compat
from pycoll.algorithms import ALGORITHMS, get
from pycoll.algorithms.schedule import (
    displacements,
    validate,
)
from pycoll.core.executor import Executor
from pycoll.core.reductions import COMPLEX, FLOATING, INTEGER, make_reduction
from pycoll.errors import PeerClosedError
from pycoll.testing.memory import MemoryHub
from pycoll.wire import Signature

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex64, torch.complex128]


OPS = ["sum", "product", "min", "max", "band", "bor", "bxor", "avg", "premul_sum"]


REDUCING = ["all_reduce", "reduce", "reduce_scatter"]


ROOTED = ["broadcast", "reduce", "gather", "scatter"]


ALL = [(c, a) for c, algos in ALGORITHMS.items() for a in algos]


FACTOR = 0.5


SEG = 64  # bytes: the executor's minimum, so most transfers take several frames


def reduction_for(op: str, dtype: torch.dtype, world: int):
    if op == "premul_sum":
        return make_reduction(torch_compat.premul_sum(FACTOR), dtype, world)
    return make_reduction(op, dtype, world)


def defined(op: str, dtype: torch.dtype) -> bool:
    if op == "premul_sum" and dtype in INTEGER:
        # torch defines PREMUL_SUM for floating types only; an earlier make_reduction
        # accepted integers, and Reduction.prepare then failed to scale them in place.
        return False
    try:
        reduction_for(op, dtype, 2)
        return True
    except ValueError:
        return False


def make_input(n: int, dtype: torch.dtype, op: str, gen: torch.Generator) -> torch.Tensor:
    """Values that keep every reduction exact (no rounding) in ``dtype``."""
    def pick(choices):
        return torch.tensor(choices)[torch.randint(len(choices), (n,), generator=gen)]
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype in COMPLEX:
        if op == "product":
            return pick([1, -1, 1j, -1j, 2, 0.5j]).to(dtype)
        re, im = (torch.randint(-8, 9, (n,), generator=gen) for _ in range(2))
        return torch.complex(re.double(), im.double()).to(dtype)
    if op == "product":
        return pick([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0] if dtype in FLOATING else [1, 2, 3]).to(dtype)
    lo = 0 if dtype is torch.uint8 else -8
    return torch.randint(lo, lo + 17, (n,), generator=gen).to(dtype)


def _combine(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype is torch.bool:
        op = {"sum": "bor", "product": "band", "min": "band", "max": "bor"}.get(op, op)
    return {"sum": torch.add, "avg": torch.add, "premul_sum": torch.add, "product": torch.mul,
            "min": torch.minimum, "max": torch.maximum, "band": torch.bitwise_and,
            "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op](a, b)


def reference(op: str, xs: Iterable[torch.Tensor], factor: float = FACTOR) -> torch.Tensor:
    """The reduction ``op`` (a ReduceOp's lower-case name) of every rank's contribution, in
    rank order, computed directly with torch (not with pycoll): ``premul_sum`` scales each
    input by ``factor`` first, ``avg`` divides the sum by the number of inputs (truncating for
    integers). ``xs`` may be a generator: it is folded two tensors at a time, so a large
    message from many ranks costs two of them in memory. The one whole-world reference of the
    unit tests, the registered-memory and vs-gloo tests, and the benchmark's check."""
    out, count = None, 0
    for x in xs:
        if op == "premul_sum":
            x = x * factor
        out = x.clone() if out is None else _combine(op, out, x)
        count += 1
    if out is None:
        raise ValueError("reference: no inputs")
    if op == "avg":
        if out.is_floating_point() or out.is_complex():
            out = out / count
        else:
            out = torch.div(out, count, rounding_mode="trunc")
    return out


def execute(collective: str, scheds, bufs, reduction, dtype, numel, root=-1, seg=SEG) -> None:
    world = len(scheds)
    for s in scheds:
        validate(s)
    sig = Signature(collective, 0, str(dtype), numel, reduction.name if reduction else "", root)
    transports = MemoryHub(world).transports()
    errors: list[BaseException | None] = [None] * world

    def rank_main(r: int) -> None:
        try:
            Executor(transports[r], seg).run(scheds[r], dict(bufs[r]), sig, reduction,
                                             time.monotonic() + 30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[r] = exc
            transports[r].abort(repr(exc))

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    first = [e for e in errors if e is not None and not isinstance(e, PeerClosedError)]
    if first or any(errors):
        raise first[0] if first else next(e for e in errors if e)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (also for bfloat16 and NaN-free floats of any kind)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_case(collective: str, algo: str, world: int, count, dtype=torch.float32, op="sum",
             root: int = 0, seed: int = 0, seg: int = SEG) -> None:
    """Run one collective on every rank and check it against the reference.

    ``count`` is an int, except a list of per-rank counts for reduce_scatter and a
    world x world matrix ``send[src][dst]`` for all_to_all.
    """
    gen = torch.Generator().manual_seed(seed)
    fn = get(collective, algo)
    red = reduction_for(op, dtype, world) if collective in REDUCING else None
    prep = (lambda t: red.prepare(t) or t) if red else (lambda t: t)

    def data(n: int) -> torch.Tensor:
        return make_input(n, dtype, op, gen)

    bufs: list[dict[str, torch.Tensor]] = []
    if collective == "all_reduce":
        xs = [data(count) for _ in range(world)]
        bufs = [{"out": prep(x.clone())} for x in xs]
        scheds = [fn(r, world, count) for r in range(world)]
        want = [reference(op, xs)] * world
    elif collective == "reduce":
        xs = [data(count) for _ in range(world)]
        bufs = [{"out" if r == root else "in": prep(x.clone())} for r, x in enumerate(xs)]
        scheds = [fn(r, world, count, root) for r in range(world)]
        want = [reference(op, xs) if r == root else None for r in range(world)]
    elif collective == "reduce_scatter":
        counts, disp = count, displacements(count)
        xs = [data(sum(counts)) for _ in range(world)]
        bufs = [{"in": prep(x.clone()), "out": data(counts[r])} for r, x in enumerate(xs)]
        scheds = [fn(r, world, counts) for r in range(world)]
        want = [reference(op, [x[disp[r]:disp[r] + counts[r]] for x in xs]) for r in range(world)]
    elif collective == "broadcast":
        xs = [data(count) for _ in range(world)]
        bufs = [{"out": x.clone()} for x in xs]
        scheds = [fn(r, world, count, root) for r in range(world)]
        want = [xs[root]] * world
    elif collective == "all_gather":
        xs = [data(count) for _ in range(world)]
        bufs = [{"in": x.clone(), "out": data(world * count)} for x in xs]
        scheds = [fn(r, world, count) for r in range(world)]
        want = [torch.cat(xs)] * world
    elif collective == "all_to_all":
        send = count
        recv = [[send[s][r] for s in range(world)] for r in range(world)]
        xs = [data(sum(send[r])) for r in range(world)]
        disp = [displacements(send[r]) for r in range(world)]
        bufs = [{"in": xs[r].clone(), "out": data(sum(recv[r]))} for r in range(world)]
        scheds = [fn(r, world, send[r], recv[r]) for r in range(world)]
        want = [torch.cat([xs[s][disp[s][r]:disp[s][r] + send[s][r]] for s in range(world)])
                for r in range(world)]
    elif collective == "gather":
        xs = [data(count) for _ in range(world)]
        bufs = [{"in": x.clone(), **({"out": data(world * count)} if r == root else {})}
                for r, x in enumerate(xs)]
        scheds = [fn(r, world, count, root) for r in range(world)]
        want = [torch.cat(xs) if r == root else None for r in range(world)]
    elif collective == "scatter":
        xs = [data(world * count) for _ in range(world)]
        bufs = [{"out": data(count), **({"in": xs[r].clone()} if r == root else {})}
                for r in range(world)]
        scheds = [fn(r, world, count, root) for r in range(world)]
        want = [xs[root][r * count:(r + 1) * count] for r in range(world)]
    else:
        raise AssertionError(collective)
    with_in = [b for b in bufs if "in" in b]
    inputs_before = [b["in"].clone() for b in with_in]
    if isinstance(count, int):
        numel = count
    else:
        numel = sum(map(sum, count)) if collective == "all_to_all" else sum(count)
    execute(collective, scheds, bufs, red, dtype, numel, root if collective in ROOTED else -1, seg)
    what = f"{collective}/{algo} world={world} count={count} dtype={dtype} op={op} root={root}"
    assert all(same(a, b["in"]) for a, b in zip(inputs_before, with_in)), \
        f"{what}: 'in' was modified"
    for r in range(world):
        if want[r] is None:
            continue
        got = bufs[r]["out"]
        if red is not None:
            red.finish(got)
        # Value equality: another reduction order may legitimately flip the sign of a zero.
        assert torch.equal(got, want[r].to(dtype)), f"{what}: rank {r} got {got} want {want[r]}"
    if collective == "all_reduce":
        assert all(same(bufs[0]["out"], b["out"]) for b in bufs), f"{what}: ranks differ"


def counts_arg(collective: str, world: int, n: int):
    """The count argument for a total size ``n``: uneven splits where the collective has them."""
    if collective == "reduce_scatter":
        return [n // world + (1 if r < n % world else 0) for r in range(world)]
    if collective == "all_to_all":
        return [[(n + s + 2 * d) % (n + 1) for d in range(world)] for s in range(world)]
    return n
