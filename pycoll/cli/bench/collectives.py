"""The collective table of the benchmark, in the shape of nccl-tests.

One small entry per collective: how a size in bytes becomes element counts, how the buffers are
initialised (deterministic, rank-dependent), what the result must be, the bus-bandwidth factor,
and one ``run`` function written against backend-neutral verbs (``api.all_reduce(...)``) so the
same entry drives torch.distributed groups (gloo, pycoll) and mpi4py alike. Timing, checking
and printing live in the shared harness (``harness``, ``report``).

Sizes follow nccl-tests: for all_gather / gather it is the total received bytes, for
reduce_scatter / scatter / all_to_all the total sent bytes; per-rank blocks are size / world.

Input values are small integers (``value(i, r) = (i + 3r + 1) % 9 - 4``; ``1 + (i + r) % 2``
for prod), so every supported dtype represents every partial result exactly and the check can be
exact whatever order a backend reduces in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pycoll.testing.reference import reference

ROOT = 0
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
    "int8": torch.int8, "uint8": torch.uint8,
}
# AVG is left out on purpose: gloo does not implement it, so there is nothing to compare.
OPS = ("sum", "prod", "max", "min")
_REDUCE_OP = {"sum": "sum", "prod": "product", "max": "max", "min": "min"}   # (ReduceOp names)


def make_input(count: int, rank: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The deterministic input of ``rank``: every rank (and the checker) can regenerate it."""
    i = torch.arange(count, dtype=torch.int32)  # int32 keeps 16M-element sweeps cheap
    if op == "prod":
        v = 1 + (i + rank) % 2  # products stay powers of two: exact in every dtype
    elif dtype == torch.uint8:
        v = (i + 3 * rank + 1) % 9
    else:
        v = (i + 3 * rank + 1) % 9 - 4
    return v.to(dtype)


def reduce_inputs(count: int, world: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The whole-world reduction of every rank's input (``pycoll.testing.reference``)."""
    return reference(_REDUCE_OP[op], (make_input(count, r, dtype, op) for r in range(world)))


def sentinel_fill(t: torch.Tensor) -> None:
    """Overwrite an output before a checked iteration so a no-op backend cannot pass the check."""
    t.fill_(float("nan") if t.is_floating_point() else 101)  # 101: never an expected value


def count_wrong(out: torch.Tensor, expected: torch.Tensor) -> int:
    # Exact comparison is right: inputs are small integers, every partial result is exact.
    # NaN != NaN, so a sentinel left in place counts as wrong.
    return int((out != expected).sum())


@dataclass(frozen=True)
class Collective:
    """One table entry. ``setup`` returns the buffers (dict) for one (size, rank)."""
    name: str
    bus_factor: Callable[[int], float]   # world -> busbw / algbw (nccl-tests PERFORMANCE.md)
    factor_text: str
    per_rank_blocks: bool                # size is split into world blocks of size / world bytes
    inplace: bool                        # input is overwritten: reset it before every iteration
    setup: Callable[..., dict]           # (count, rank, world, dtype, op) -> buffers
    run: Callable[..., None]             # (api, bufs, rank, world) -> None
    check: Callable[..., int] | None     # (bufs, rank, world) -> #wrong elements; None: no data
    time_scale: float = 1.0              # ping-pong reports half a round trip

    def counts(self, nbytes: int, world: int, elt: int) -> tuple[int, int]:
        """(count, bytes actually moved) for a requested size; never less than one element."""
        if self.name == "barrier":
            return 0, 0
        if self.per_rank_blocks:
            block = max(1, nbytes // elt // world)
            return block * world, block * world * elt
        count = max(1, nbytes // elt)
        return count, count * elt


def _fraction(n: int) -> float:
    return (n - 1) / n


# --- all_reduce: in place, every rank ends with the reduction of all inputs. ---------------------

def _ar_setup(count, rank, world, dtype, op):
    init = make_input(count, rank, dtype, op)
    return {"init": init, "buf": init.clone(), "expected": reduce_inputs(count, world, dtype, op)}


def _inplace_check(bufs, rank, world):
    return count_wrong(bufs["buf"], bufs["expected"])


# --- broadcast: the root's buffer reaches everyone. ---------------------------------------------

def _bc_setup(count, rank, world, dtype, op):
    init = make_input(count, rank, dtype, op)
    return {"init": init, "buf": init.clone(), "expected": make_input(count, ROOT, dtype, op),
            "out": None if rank == ROOT else "buf"}


# --- reduce: in place; only the root's result is defined (gloo uses other ranks as scratch). -----

def _red_setup(count, rank, world, dtype, op):
    bufs = _ar_setup(count, rank, world, dtype, op)
    if rank != ROOT:
        bufs["expected"] = None
    return bufs


def _red_check(bufs, rank, world):
    return _inplace_check(bufs, rank, world) if rank == ROOT else 0


# --- all_gather (into one tensor): block r of the output is rank r's input. --------------------

def _ag_setup(count, rank, world, dtype, op):
    block = count // world
    expected = torch.cat([make_input(block, r, dtype, op) for r in range(world)])
    return {"inp": make_input(block, rank, dtype, op), "out": torch.empty(count, dtype=dtype),
            "expected": expected}


def _out_check(bufs, rank, world):
    return 0 if bufs["expected"] is None else count_wrong(bufs["out"], bufs["expected"])


# --- reduce_scatter (tensor form): rank r gets block r of the reduction. ------------------------

def _rs_setup(count, rank, world, dtype, op):
    block = count // world
    full = reduce_inputs(count, world, dtype, op)
    return {"inp": make_input(count, rank, dtype, op), "out": torch.empty(block, dtype=dtype),
            "expected": full[rank * block:(rank + 1) * block].clone()}


# --- all_to_all_single: block j of rank r's output is block r of rank j's input. ----------------

def _a2a_setup(count, rank, world, dtype, op):
    block = count // world
    expected = torch.cat([make_input(count, j, dtype, op)[rank * block:(rank + 1) * block]
                          for j in range(world)])
    return {"inp": make_input(count, rank, dtype, op), "out": torch.empty(count, dtype=dtype),
            "expected": expected}


# --- gather: the root receives every rank's block, in rank order. -------------------------------

def _ga_setup(count, rank, world, dtype, op):
    bufs = _ag_setup(count, rank, world, dtype, op)
    if rank != ROOT:
        bufs["out"], bufs["expected"] = None, None
    return bufs


# --- scatter: rank r receives block r of the root's input. --------------------------------------

def _sc_setup(count, rank, world, dtype, op):
    block = count // world
    root_in = make_input(count, ROOT, dtype, op)
    return {"inp": root_in if rank == ROOT else None, "out": torch.empty(block, dtype=dtype),
            "expected": root_in[rank * block:(rank + 1) * block].clone()}


# --- sendrecv: ping-pong between ranks 2k and 2k+1 (an odd last rank sits out). -----------------

def pingpong_peer(rank: int, world: int) -> int | None:
    peer = rank ^ 1
    return peer if peer < world else None


def _pp_setup(count, rank, world, dtype, op):
    peer = pingpong_peer(rank, world)
    return {"inp": make_input(count, rank, dtype, op), "out": torch.empty(count, dtype=dtype),
            "expected": None if peer is None else make_input(count, peer, dtype, op)}


def _pp_run(api, bufs, rank, world):
    peer = pingpong_peer(rank, world)
    if peer is None:
        return
    if rank % 2 == 0:  # the even rank serves first, so the pair never both block in recv
        api.send(bufs["inp"], peer)
        api.recv(bufs["out"], peer)
    else:
        api.recv(bufs["out"], peer)
        api.send(bufs["inp"], peer)


COLLECTIVES: dict[str, Collective] = {c.name: c for c in [
    Collective("all_reduce", lambda n: 2 * (n - 1) / n, "2(n-1)/n", False, True, _ar_setup,
               lambda api, b, r, n: api.all_reduce(b["buf"]), _inplace_check),
    Collective("broadcast", lambda n: 1.0, "1", False, False, _bc_setup,
               lambda api, b, r, n: api.broadcast(b["buf"], ROOT),
               lambda b, r, n: count_wrong(b["buf"], b["expected"])),
    Collective("reduce", lambda n: 1.0, "1", False, True, _red_setup,
               lambda api, b, r, n: api.reduce(b["buf"], ROOT, r == ROOT), _red_check),
    Collective("all_gather", _fraction, "(n-1)/n", True, False, _ag_setup,
               lambda api, b, r, n: api.all_gather(b["out"], b["inp"]), _out_check),
    Collective("reduce_scatter", _fraction, "(n-1)/n", True, False, _rs_setup,
               lambda api, b, r, n: api.reduce_scatter(b["out"], b["inp"]), _out_check),
    Collective("all_to_all", _fraction, "(n-1)/n", True, False, _a2a_setup,
               lambda api, b, r, n: api.all_to_all(b["out"], b["inp"]), _out_check),
    Collective("gather", _fraction, "(n-1)/n", True, False, _ga_setup,
               lambda api, b, r, n: api.gather(b["out"], b["inp"], ROOT, r == ROOT), _out_check),
    Collective("scatter", _fraction, "(n-1)/n", True, False, _sc_setup,
               lambda api, b, r, n: api.scatter(b["out"], b["inp"], ROOT, r == ROOT),
               _out_check),
    Collective("barrier", lambda n: 0.0, "-", False, False,
               lambda count, rank, world, dtype, op: {},
               lambda api, b, r, n: api.barrier(), None),
    Collective("sendrecv", lambda n: 1.0, "1", False, False, _pp_setup, _pp_run, _out_check,
               time_scale=0.5),
]}


def reset(coll: Collective, bufs: dict, checked: bool) -> None:
    """Prepare one iteration (outside the timed region)."""
    if coll.inplace:
        bufs["buf"].copy_(bufs["init"])  # a sum applied twice would be a different (wrong) result
    if checked and not coll.inplace:
        out = bufs.get("out")
        if out == "buf":  # broadcast receivers: the data buffer is the output
            sentinel_fill(bufs["buf"])
        elif isinstance(out, torch.Tensor):
            sentinel_fill(out)


def participates(coll: Collective, rank: int, world: int) -> bool:
    """False for a rank that does nothing in this collective (its time is left out)."""
    return coll.name != "sendrecv" or pingpong_peer(rank, world) is not None
