"""Every algorithm in pycoll.algorithms, run as threads over the in-memory transport.

Each case builds every rank's inputs, computes the whole-world result directly from them
(the reference, as torch's multi_threaded_pg does), runs every rank's schedule through the
real Executor with a small segment size (so transfers are cut into several frames), and
checks: the result on every rank, "in" never modified, validate() on every schedule, and
for all_reduce that all ranks' outputs are bitwise identical. Inputs are small integers
(or powers of two for products), so float results are exact and compared exactly.

Matrices: every dtype x every op on two world sizes; every world size 1..9 x counts
(0, 1, 13, not divisible by the world) on one dtype; 4 MiB on a few world sizes; and a
hypothesis property test over random worlds, counts, roots and uneven splits.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycoll.algorithms import ALGORITHMS, get
from pycoll.algorithms.schedule import (
    COMM,
    Recv,
    RecvReduce,
    Send,
    displacements,
    validate,
)
from pycoll.core.executor import Executor
from pycoll.core.reductions import COMPLEX, FLOATING, INTEGER, make_reduction
from pycoll.errors import PeerClosedError
from pycoll.testing.memory import MemoryHub
from pycoll.wire import Signature

pytestmark = pytest.mark.timeout(120)

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
        import torch.distributed as dist
        return make_reduction(dist._make_nccl_premul_sum(FACTOR), dtype, world)
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


# ---- inputs and the whole-world reference ----------------------------------------------

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


def reference(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """The reduction of every rank's contribution, computed directly (not with pycoll)."""
    xs = [x * FACTOR if op == "premul_sum" else x for x in xs]
    out = xs[0].clone()
    for x in xs[1:]:
        out = _combine(op, out, x)
    if op == "avg":
        if out.is_floating_point() or out.is_complex():
            out = out / len(xs)
        else:
            out = torch.div(out, len(xs), rounding_mode="trunc")
    return out


# ---- running a world of ranks -----------------------------------------------------------

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


# ---- the matrices -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("collective,algo", [(c, a) for c, a in ALL if c in REDUCING])
def test_every_dtype_and_op(collective, algo, dtype):
    ops = [op for op in OPS if defined(op, dtype)]
    assert ops
    for world, n in ((3, 13), (4, 10)):
        for op in ops:
            run_case(collective, algo, world, counts_arg(collective, world, n), dtype, op,
                     root=world - 1, seed=world)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("collective,algo",
                         [(c, a) for c, a in ALL if c not in REDUCING and c != "barrier"])
def test_every_dtype_moves(collective, algo, dtype):
    for world, n in ((3, 13), (4, 10), (2, 7)):
        run_case(collective, algo, world, counts_arg(collective, world, n), dtype, root=1)


@pytest.mark.parametrize("world", range(1, 10))
@pytest.mark.parametrize("collective,algo", [(c, a) for c, a in ALL if c != "barrier"])
def test_every_world_and_count(collective, algo, world):
    roots = sorted({0, world // 2, world - 1}) if collective in ROOTED else [0]
    for n in (0, 1, 13, 3 * world + 1):
        for root in roots:
            run_case(collective, algo, world, counts_arg(collective, world, n), torch.int32,
                     root=root, seed=n)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("collective,algo", [(c, a) for c, a in ALL if c != "barrier"])
def test_four_mebibytes(collective, algo, world):
    n = 1 << 20  # float32: 4 MiB per rank (the whole buffer for the block-split collectives)
    if collective in ("all_gather", "gather", "scatter"):
        n //= world
    count = ([[n // world] * world for _ in range(world)] if collective == "all_to_all"
             else counts_arg(collective, world, n))
    run_case(collective, algo, world, count, torch.float32, root=world - 1, seg=1 << 20)


@pytest.mark.parametrize("algo", list(ALGORITHMS["all_reduce"]))
def test_all_reduce_bitwise_identical_on_inexact_floats(algo):
    """Random floats round differently in different orders, and torch's complex product is
    not bitwise commutative for short tensors: every rank must still end bit-identical."""
    fn = get("all_reduce", algo)
    for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "sum"), (torch.float64, "product"),
                      (torch.complex64, "product"), (torch.complex128, "product")):
        red = make_reduction(op, dtype, 1)
        for world in range(1, 10):
            gen = torch.Generator().manual_seed(world)
            n = 7 if op == "product" else 37  # short tensors hit torch's scalar (FMA) tails
            xs = [1 + 0.1 * torch.randn(n, generator=gen, dtype=torch.complex128)
                  if op == "product" else torch.randn(n, generator=gen, dtype=torch.float64)
                  for _ in range(world)]
            xs = [(x if dtype.is_complex else x.real).to(dtype) for x in xs]
            bufs = [{"out": x.clone()} for x in xs]
            execute("all_reduce", [fn(r, world, n) for r in range(world)], bufs, red, dtype, n)
            assert all(same(bufs[0]["out"], b["out"]) for b in bufs), f"{dtype} world {world}"
            want = torch.stack(xs).to(torch.complex128)
            want = want.prod(0) if op == "product" else want.sum(0)
            torch.testing.assert_close(bufs[0]["out"].to(torch.complex128), want,
                                       rtol=2e-2, atol=2e-2)


def test_barrier_waits_for_everyone():
    fn = get("barrier", "dissemination")
    for world in range(1, 10):
        scheds = [fn(r, world) for r in range(world)]
        for s in scheds:
            validate(s)
            assert all(a.count == 0 and a.start == 0 and a.buf == "out"
                       for step in s.steps for a in step)
        entered, left = [0.0] * world, [0.0] * world
        transports = MemoryHub(world).transports()

        def rank_main(r: int) -> None:
            time.sleep(0.002 * (r % 3))
            entered[r] = time.monotonic()
            Executor(transports[r]).run(scheds[r], {"out": torch.empty(0, dtype=torch.uint8)},
                                        Signature("barrier", 0, "uint8", 0), None,
                                        time.monotonic() + 10)
            left[r] = time.monotonic()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert all(left) and min(left) >= max(entered), f"world {world}"


# ---- pure properties of the schedules ---------------------------------------------------

def schedules_for(collective: str, algo: str, world: int, n: int, root: int = 0):
    fn, c = get(collective, algo), counts_arg(collective, world, n)
    if collective == "barrier":
        return [fn(r, world) for r in range(world)]
    if collective == "all_to_all":
        return [fn(r, world, c[r], [c[s][r] for s in range(world)]) for r in range(world)]
    if collective in ROOTED:
        return [fn(r, world, c, root) for r in range(world)]
    return [fn(r, world, c) for r in range(world)]


@pytest.mark.parametrize("collective,algo", ALL)
def test_messages_pair_up_and_temps_are_small(collective, algo):
    """Per ordered pair, the sender's messages and the receiver's match one for one in size
    (zero-size ones included); world 1 never communicates; temps stay within bounds."""
    for world in range(1, 10):
        for n in (0, 1, 13):
            scheds = schedules_for(collective, algo, world, n, root=world // 2)
            sent = {(s.rank, a.peer): [] for s in scheds for step in s.steps for a in step
                    if isinstance(a, COMM)}
            got = {k: [] for k in sent}
            for s in scheds:
                validate(s)
                for step in s.steps:
                    for a in step:
                        if isinstance(a, Send):
                            sent.setdefault((s.rank, a.peer), []).append(a.count)
                        elif isinstance(a, (Recv, RecvReduce)):
                            got.setdefault((a.peer, s.rank), []).append(a.count)
                tmp = sum(s.temps.values())
                if collective == "all_reduce":
                    assert tmp == 0 if algo in ("ring", "halving_doubling", "tree") else tmp <= n
                elif collective in ("reduce", "reduce_scatter"):
                    assert all(v <= n for v in s.temps.values())
            assert sent == got, f"{collective}/{algo} world {world} count {n}"
            if world == 1:
                assert not any(isinstance(a, COMM)
                               for s in scheds for step in s.steps for a in step)


def test_registry():
    assert set(ALGORITHMS) == {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                               "all_to_all", "gather", "scatter", "barrier"}
    with pytest.raises(ValueError, match="halving_doubling, recursive_doubling, ring, tree"):
        get("all_reduce", "nope")
    with pytest.raises(ValueError, match="valid: all_gather"):
        get("allreduce", "ring")
    # PYCOLL_ALGO=recursive_doubling applies to all_gather too: it must work on any world.
    assert get("all_gather", "recursive_doubling")(0, 3, 4).name == "bruck_allgather"
    assert get("all_gather", "recursive_doubling")(0, 4, 4).name == "recursive_doubling_allgather"


def test_all_to_all_rejects_inconsistent_self_block():
    with pytest.raises(ValueError, match="to itself"):
        get("all_to_all", "pairwise")(0, 2, [1, 2], [3, 2])


# ---- property test ----------------------------------------------------------------------

@st.composite
def cases(draw):
    collective, algo = draw(st.sampled_from([(c, a) for c, a in ALL if c != "barrier"]))
    world = draw(st.integers(1, 9))
    sizes = st.integers(0, 7)
    if collective == "reduce_scatter":
        count = draw(st.lists(sizes, min_size=world, max_size=world))
    elif collective == "all_to_all":
        count = draw(st.lists(st.lists(sizes, min_size=world, max_size=world),
                              min_size=world, max_size=world))
    else:
        count = draw(st.integers(0, 40))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from([o for o in OPS if defined(o, dtype)])) \
        if collective in REDUCING else "sum"
    return dict(collective=collective, algo=algo, world=world, count=count, dtype=dtype, op=op,
                root=draw(st.integers(0, world - 1)), seed=draw(st.integers(0, 2**16)),
                seg=draw(st.sampled_from([64, 96, 4096])))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_property_random_collectives(case):
    run_case(**case)
