"""Registered all_gather_into_tensor and reduce_scatter_tensor, and FSDP2 on registered buffers.

Real rank processes on the reused pool (pycoll/testing/ranks.py), real shared memory. The in-place
forms (``shm.registered``) against a reference in rank order for every dtype and op
and world sizes 2-4, with the path taken counted; a registration that differs between ranks
is a MismatchError on every rank; and FSDP2 with
``set_allocate_memory_from_process_group_for_comm(True)`` (its buffers from the group's
``allocate_tensor``) trains to the same parameters as FSDP2 on gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pycoll.testing.ranks import run_ranks
from tests.support.registered import DTYPE_OPS, _inputs, _redop, _reference

pytestmark = pytest.mark.timeout(300)


def _count_in_place():
    """Count the registered collectives' in-place rounds in this rank (the path taken)."""
    from pycoll.shm import registered as R

    calls, original = [], R._in_place

    def counted(*args):
        calls.append(args[3])
        return original(*args)
    R._in_place = counted
    return calls, lambda: setattr(R, "_in_place", original)


def _close(got, ref, dtype) -> bool:
    if dtype.is_floating_point or dtype.is_complex:
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
        return torch.allclose(got.to(ref.dtype), ref, rtol=tol, atol=tol)
    return torch.equal(got, ref)


def _gather_and_scatter(rank, world, cases):
    import pycoll

    calls, undo = _count_in_place()
    out = []
    try:
        for n, dtype, op in cases:
            # all_gather_into_tensor, in place as FSDP2 does it (input = block rank of output)
            # and from a separate input.
            for in_place in (True, False):
                o = pycoll.empty_shared((n * world,), dtype=dtype)
                mine = _inputs(rank, n, dtype, op)
                inp = o[rank * n:(rank + 1) * n] if in_place else mine.clone()
                inp.copy_(mine)
                before = len(calls)
                dist.all_gather_into_tensor(o, inp)
                ref = torch.cat([_inputs(q, n, dtype, op) for q in range(world)])
                out.append(("all_gather", n, str(dtype), in_place, torch.equal(o, ref), len(calls) - before))
            # reduce_scatter_tensor: block rank of everyone's registered input, reduced.
            big = pycoll.empty_shared((n * world,), dtype=dtype)
            big.copy_(_inputs(rank, n * world, dtype, op))
            res = torch.empty(n, dtype=dtype)
            before = len(calls)
            dist.reduce_scatter_tensor(res, big, op=_redop(op, dtype))
            ref = _reference(world, n * world, dtype, op)[rank * n:(rank + 1) * n]
            out.append(("reduce_scatter", n, str(dtype), op, _close(res, ref, dtype), len(calls) - before))
    finally:
        undo()
    return out


def _cases():
    cases = []
    for dtype, ops in DTYPE_OPS:
        item = torch.empty(0, dtype=dtype).element_size()
        for op in ops:
            for n in (1, 65536 // item + 3, (3 * 65536 + 11) // item):
                cases.append((n, dtype, op))
    return cases


@pytest.mark.parametrize("world", [2, 3, 4])
def test_registered_all_gather_and_reduce_scatter_every_dtype_and_op(world):
    cases = _cases() if world < 4 else [c for c in _cases() if c[1] in (torch.float32, torch.int64)]
    results = run_ranks(_gather_and_scatter, world, cases, backend="pycoll", timeout=240)
    for rows in results:
        bad = [r for r in rows if not r[4]]
        assert not bad, bad[:5]
        for r in rows:
            op_bytes = r[1] * torch.empty(0, dtype=getattr(torch, r[2].removeprefix("torch."))).element_size()
            # all_gather looks at its input's bytes, reduce_scatter at its input's (world blocks);
            # premul_sum's input is scaled into a copy, which is not registered.
            looked = op_bytes > 65536 if r[0] == "all_gather" else op_bytes * world > 65536
            expect = 1 if looked and not (r[0] == "reduce_scatter" and r[3] == "premul_sum") else 0
            assert r[5] == expect, r


def _mismatch(rank, world):
    import pycoll

    n = 40000
    shared = pycoll.empty_shared((n * world,))     # a collective: every rank allocates
    o = shared if rank == 0 else torch.empty(n * world)
    got = []
    try:
        dist.all_gather_into_tensor(o, torch.full((n,), float(rank)))
        got.append("no error")
    except Exception as exc:   # noqa: BLE001 - the test reports what each rank saw
        got.append(f"{type(exc).__name__}: {exc}")
    return got


def test_registration_that_differs_is_a_mismatch_on_every_rank():
    results = run_ranks(_mismatch, 2, backend="pycoll", timeout=60)
    for got in results:
        assert got[0].startswith("MismatchError") and "registered memory" in got[0], results


# -- FSDP2 --------------------------------------------------------------------------------
def _fsdp_train(rank, world, registered: bool):
    from torch.distributed.fsdp import fully_shard

    calls = undo = None
    if dist.get_backend() == "pycoll":
        calls, undo = _count_in_place()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 4))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        if registered:
            for m in model.modules():   # each fully_shard-ed module has its own comms
                if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
                    m.set_allocate_memory_from_process_group_for_comm(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(4):
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 4, (32,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    finally:
        if undo is not None:
            undo()
    return losses, full, (sorted(set(calls)) if calls is not None else None)


def test_fsdp2_on_registered_buffers_trains_as_on_gloo():
    ours = run_ranks(_fsdp_train, 2, True, backend="pycoll", timeout=180)
    gloo = run_ranks(_fsdp_train, 2, True, backend="gloo", timeout=180)
    for (losses, full, calls), (g_losses, g_full, _) in zip(ours, gloo):
        # FSDP2 really ran its gathers and scatters in place in the group's heap.
        assert any(c.startswith("all_gather") for c in calls), calls
        assert any(c.startswith("reduce_scatter") for c in calls), calls
        assert losses == pytest.approx(g_losses, rel=1e-5, abs=1e-6)
        for k in g_full:
            assert torch.allclose(full[k], g_full[k], rtol=1e-5, atol=1e-6), k
