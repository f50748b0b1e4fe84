"""Straggler attribution: when each rank arrived at each collective, who was last, by how much.

Recording is local and always on: for every collective it runs, a rank appends
``(seq, op, arrival, end)`` to ``comm.arrivals``, a deque bounded to ``PYCOLL_STATS_WINDOW``
entries (default 1024). ``arrival`` is when the op started executing on this rank (after
any injected delay), ``end`` when it finished; both ``time.monotonic()``.

Attribution needs every rank's arrivals, so ``stats()`` is a collective call (every rank
of the group calls it, like a barrier): each rank sends its window to every other rank
over the group's point-to-point engine (own tags, so neither the collective channel nor
the op sequence numbers are touched), on rank 0's clock (``clock.offset_of``, measured
once per group). A sequence number names the same collective on every rank, so records
are matched by it; only collectives that every rank has in its window are reported.
"""

from __future__ import annotations

import math
import time
import weakref

import torch

from pycoll import torch_compat
from pycoll.core import tags
from pycoll.core.communicator import ARRIVALS_WINDOW as WINDOW
from pycoll.core.executor import byte_view
from pycoll.observe.clock import offset_of

_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # communicator -> stats() calls


def _comm_of(group):
    pg = group if group is not None else torch_compat.default_group()
    comm = getattr(pg, "communicator", None)
    if comm is None:
        comm = getattr(torch_compat.cpu_backend(pg), "communicator", None)
        if comm is None:
            raise ValueError(f"pycoll.stats: {pg!r} is not a pycoll process group")
    return comm


def stats(group=None, timeout: float | None = None) -> dict:
    """Per-collective arrivals and a per-rank straggler summary of ``group`` (default: world).

    Collective: every rank of the group must call it. Returns a dict (JSON-friendly):
    ``collectives``: one record per collective (``seq``, ``op``, ``arrivals``: seconds after
    the first rank arrived, by rank; ``last``: the last rank; ``lateness``: how long after
    the second-to-last rank it arrived; ``spread``: last minus first; ``durations``:
    seconds each rank spent in the op); ``ranks``: per rank ``last`` (times last),
    ``mean_lateness`` (over the collectives where it was last), ``mean_delay`` (arrival after
    the first rank, over all); ``straggler``: the rank with the most lateness in all, if
    it was last in more than half of the collectives (else None); ``clock``: offsets and error bounds used.
    """
    return collect(_comm_of(group), timeout)


def collect(comm, timeout: float | None = None) -> dict:
    world, rank, eng = comm.world, comm.rank, comm.p2p
    _calls[comm] = calls = _calls.get(comm, 0) + 1
    tag = tags.STATS - 4 * calls
    offset, error, method = offset_of(comm, tag - 1)
    recs = comm.arrivals.copy()  # deque.copy is atomic under the GIL: no torn read
    ops = {seq: op for seq, op, _, _ in recs}
    mine = torch.full((WINDOW + 1, 3), math.nan, dtype=torch.float64)
    if recs:
        mine[:len(recs)] = torch.tensor([(s, a + offset, e + offset) for s, _, a, e in recs],
                                        dtype=torch.float64)
    mine[-1, 0], mine[-1, 1] = -1, error      # the last row carries this rank's clock error
    tables: list = [None] * world
    tables[rank] = mine
    deadline = time.monotonic() + (timeout or comm.timeout)
    reqs = []
    for p in range(world):
        if p != rank:
            tables[p] = torch.empty(WINDOW + 1, 3, dtype=torch.float64)
            reqs.append(eng.irecv(p, tag, byte_view(tables[p].view(-1)), "float64", 3 * WINDOW + 3, deadline))
    for p in range(world):
        if p != rank:
            reqs.append(eng.isend(p, tag, byte_view(mine.view(-1)), "float64", 3 * WINDOW + 3, deadline))
    for req in reqs:
        if not eng.wait(req, max(0.0, deadline - time.monotonic())) or req.error is not None:
            raise req.error or TimeoutError(f"pycoll.stats: rank {rank} timed out exchanging arrivals "
                                            f"with {req.describe()}")
    errors = [float(t[-1, 1]) for t in tables]
    per_rank = []
    for t in tables:
        rows = t[:-1][~torch.isnan(t[:-1, 0])].tolist()
        per_rank.append({int(s): (a, e) for s, a, e in rows})
    report = attribute(per_rank, ops)
    report["group"] = {"rank": rank, "world": world, "mode": comm.mode}
    report["clock"] = {"method": method, "error_s": errors}
    return report


def attribute(per_rank: list[dict[int, tuple[float, float]]], ops: dict[int, str]) -> dict:
    """``per_rank[r][seq] = (arrival, end)`` on one clock -> the report (see ``stats``)."""
    world = len(per_rank)
    common = set(per_rank[0]) if per_rank else set()
    for table in per_rank[1:]:
        common &= set(table)
    records = []
    last_count, lateness_sum, delay_sum = [0] * world, [0.0] * world, [0.0] * world
    for seq in sorted(common):
        arr = [per_rank[r][seq][0] for r in range(world)]
        order = sorted(range(world), key=arr.__getitem__)
        first, last = order[0], order[-1]
        late = arr[last] - arr[order[-2]] if world > 1 else 0.0
        records.append({"seq": seq, "op": ops.get(seq, "?"), "t_first": arr[first],
                        "arrivals": [a - arr[first] for a in arr], "last": last, "lateness": late,
                        "spread": arr[last] - arr[first],
                        "durations": [per_rank[r][seq][1] - arr[r] for r in range(world)]})
        last_count[last] += 1
        lateness_sum[last] += late
        for r in range(world):
            delay_sum[r] += arr[r] - arr[first]
    n = len(records)
    ranks = [{"rank": r, "last": last_count[r],
              "mean_lateness": lateness_sum[r] / last_count[r] if last_count[r] else 0.0,
              "total_lateness": lateness_sum[r], "mean_delay": delay_sum[r] / n if n else 0.0}
             for r in range(world)]
    # The straggler: most lateness in all, and last in more than half of the collectives
    # (ranks that take turns being last by noise name none).
    straggler = max(range(world), key=lateness_sum.__getitem__) if world > 1 and n else None
    if straggler is not None and (lateness_sum[straggler] <= 0 or 2 * last_count[straggler] <= n):
        straggler = None
    return {"collectives": records, "ranks": ranks, "straggler": straggler}


def _t(seconds: float) -> str:
    s = abs(seconds)
    return f"{seconds * 1e3:.3g} ms" if s >= 1e-3 else f"{seconds * 1e6:.3g} us"


def format_report(report: dict, recent: int = 5) -> str:
    """A few lines for people: who was last how often, by how much; the last few collectives."""
    recs, ranks = report["collectives"], report["ranks"]
    n = len(recs)
    err = max(report.get("clock", {}).get("error_s", [0.0]) or [0.0])
    lines = [f"straggler report over {n} collectives of a group of {len(ranks)} "
             f"(clock error <= {_t(err)}):"]
    for r in sorted(ranks, key=lambda x: -x["total_lateness"]):
        lines.append(f"  rank {r['rank']}: last in {r['last']}/{n}, by {_t(r['mean_lateness'])} on average "
                     f"when last; arrives {_t(r['mean_delay'])} after the first rank on average")
    s = report["straggler"]
    lines.append(f"  straggler: rank {s}" if s is not None else "  straggler: none")
    for rec in recs[-recent:]:
        arr = ", ".join(_t(a) for a in rec["arrivals"])
        lines.append(f"  {rec['op']} seq {rec['seq']}: last rank {rec['last']} by {_t(rec['lateness'])} "
                     f"(arrivals after the first: {arr})")
    return "\n".join(lines)
