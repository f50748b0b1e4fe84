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
    validate,
)
from pycoll.core.executor import Executor
from pycoll.core.reductions import make_reduction
from pycoll.testing.memory import MemoryHub
from pycoll.testing.reference import (
    ALL,
    DTYPES,
    OPS,
    REDUCING,
    ROOTED,
    counts_arg,
    defined,
    execute,
    run_case,
    same,
)
from pycoll.wire import Signature

pytestmark = pytest.mark.timeout(120)


# ---- inputs and the whole-world reference ----------------------------------------------


# ---- running a world of ranks -----------------------------------------------------------


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
