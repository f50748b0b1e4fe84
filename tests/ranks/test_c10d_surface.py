"""The rest of the torch.distributed CPU surface on pycoll, against gloo where gloo has it.

Work objects (wait, is_completed, is_success, exception, get_future, completion in issue
order), point-to-point (tags, any-source receive, isend/irecv, batch_isend_irecv rings),
object collectives, overlapping subgroups used in interleaved order, pycoll's monitored
barrier, argument checks that must fail on the calling rank before any communication, and
non-contiguous tensors (which pycoll handles; gloo rejects them).
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pycoll.errors import CommError
from pycoll.testing.ranks import run_ranks
from tests.support.vs_gloo import BOOL, DTYPES, TRANSPORTS, Checker, _assert_clean, gen, reference, seed_of

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _result(ck: Checker) -> dict:
    return {"fails": ck.fails, "checks": ck.checks}


# -- Work ---------------------------------------------------------------------------------------
def _async_ops(rank: int, world: int, group):
    """(name, issue() -> (work, outputs)) for every collective with async_op=True."""
    def t(seed, n=5, dtype=torch.float32):
        return gen(dtype, n, seed_of(20, seed, rank))

    def ops():
        yield "all_reduce", lambda: _w(dist.all_reduce, (x := t(1)), group=group, async_op=True) + (x,)
        yield "broadcast", lambda: _w(dist.broadcast, (x := t(2)), src=world - 1, group=group, async_op=True) + (x,)
        yield "reduce", lambda: _w(dist.reduce, (x := t(3)), dst=0, group=group, async_op=True) + (x if rank == 0 else None,)
        yield "all_gather", lambda: _w(dist.all_gather, (o := [torch.zeros(5) for _ in range(world)]), t(4),
                                       group=group, async_op=True) + (o,)
        yield "all_gather_into_tensor", lambda: _w(dist.all_gather_into_tensor, (o := torch.zeros(5 * world)), t(5),
                                                   group=group, async_op=True) + (o,)
        yield "gather", lambda: _w(dist.gather, t(6), (o := [torch.zeros(5) for _ in range(world)] if rank == 0 else None),
                                   dst=0, group=group, async_op=True) + (o,)
        yield "scatter", lambda: _w(dist.scatter, (o := torch.zeros(5)),
                                    [gen(torch.float32, 5, seed_of(21, j)) for j in range(world)] if rank == 0 else None,
                                    src=0, group=group, async_op=True) + (o,)
        yield "reduce_scatter", lambda: _w(dist.reduce_scatter, (o := torch.zeros(5)), [t(7 + j) for j in range(world)],
                                           group=group, async_op=True) + (o,)
        yield "reduce_scatter_tensor", lambda: _w(dist.reduce_scatter_tensor, (o := torch.zeros(5)), t(12, 5 * world),
                                                  group=group, async_op=True) + (o,)
        yield "all_to_all", lambda: _w(dist.all_to_all, (o := [torch.zeros(5) for _ in range(world)]),
                                       [t(13 + j) for j in range(world)], group=group, async_op=True) + (o,)
        yield "all_to_all_single", lambda: _w(dist.all_to_all_single, (o := torch.zeros(5 * world)), t(19, 5 * world),
                                              group=group, async_op=True) + (o,)
        yield "barrier", lambda: _w(dist.barrier, group=group, async_op=True) + (None,)
    return list(ops())


def _w(fn, *args, **kw):
    return (fn(*args, **kw),)


def _work_semantics(rank: int, world: int) -> dict:
    ck = Checker(rank, world, "work")
    gloo = dist.new_group(backend="gloo")
    # 1. Each async op: wait/is_completed/is_success/exception/future as gloo's.
    for (name, p_issue), (_, g_issue) in zip(_async_ops(rank, world, None), _async_ops(rank, world, gloo)):
        pw, pout = p_issue()
        gw, gout = g_issue()
        for label, w in (("pycoll", pw), ("gloo", gw)):
            if not isinstance(w, dist.Work):
                ck.fail(name, f"{label} returned {type(w).__name__}, not a Work")
        pr, gr = pw.wait(), gw.wait()
        if pr is not True or gr is not True:
            ck.fail(name, f"wait() returned {pr!r} (gloo {gr!r})")
        # (gloo's reduce_scatter Work reports is_completed() False even after wait(): not copied)
        if not (pw.is_completed() and pw.is_success()):
            ck.fail(name, f"after wait(): is_completed() {pw.is_completed()}, is_success() {pw.is_success()}")
        if pw.exception() is not None:
            ck.fail(name, f"exception() after success: {pw.exception()!r}")
        ck.same(f"{name} output", pout, gout, "approx")
        pf = pw.get_future()
        if not pf.done():
            ck.fail(name, "future not done after wait()")
        try:
            gv = gw.get_future().wait()
        except RuntimeError:
            gv = None  # gloo has no future for this op; pycoll still gives one
        pv = pf.wait()
        if name == "all_gather_into_tensor":
            # gloo's value is its internal per-rank chunk list; pycoll's is [output], as NCCL's
            ck.same(f"{name} future value", pv, [pout])
            ck.same(f"{name} future value (gloo chunks)", torch.cat(gv) if gv else None, gout)
        elif name == "reduce" and rank != 0:
            ck.same(f"{name} future value", pv, [pw._outputs[0]])   # gloo's holds scratch here
        elif gv is not None:
            ck.same(f"{name} future value vs gloo", pv, gv, "approx")
        elif name in ("reduce_scatter", "reduce_scatter_tensor"):
            ck.same(f"{name} future value", pv, [pout])
        chained = pf.then(lambda f: f.value())
        if chained.wait() is not pv and chained.wait() != pv:
            ck.fail(name, "future.then did not pass the value through")

    # 2. Operations complete in issue order: many async ops, wait on the last only.
    for trial, (group, label) in enumerate(((None, "pycoll"), (gloo, "gloo"))):
        works, outs = [], []
        for i in range(12):
            for name, issue in _async_ops(rank, world, group):
                w, o = issue()
                works.append((f"{name}#{i}", w))
                outs.append(o)
        x = torch.full((3,), float(rank))
        last = dist.all_reduce(x, group=group, async_op=True)
        last.wait()
        if label == "pycoll":
            pending = [n for n, w in works if not w.is_completed()]
            if pending:
                ck.fail("issue order", f"{len(pending)} earlier ops not completed after waiting the last: {pending[:5]}")
            if not all(w.is_success() for _, w in works):
                ck.fail("issue order", "an earlier op failed")
            p_outs = outs
        else:
            for _, w in works:
                w.wait()
            ck.same("issue-order outputs vs gloo", p_outs, outs, "approx")
        ck.same(f"{label} last all_reduce", x, torch.full((3,), float(sum(range(world)))))

    # 3. A failed async op: wait raises, exception() holds the error, the future fails too;
    #    the failure is confined to its (sub)group.
    mismatch_error = None
    if world >= 2:
        sub = dist.new_group(backend="pycoll")
        w = dist.all_reduce(torch.ones(3 + rank), group=sub, async_op=True)
        try:
            w.wait()
            ck.fail("mismatched sizes", "wait() did not raise")
        except RuntimeError as exc:
            mismatch_error = str(exc)
            if w.exception() is not exc or w.is_success() or not w.is_completed():
                ck.fail("failed work", f"exception()={w.exception()!r} is_success={w.is_success()} "
                                       f"is_completed={w.is_completed()}")
            try:
                w.get_future().wait()
                ck.fail("failed work", "future did not raise")
            except RuntimeError:
                pass
        try:
            dist.barrier(group=sub)
            ck.fail("broken subgroup", "next op on a failed group did not raise")
        except RuntimeError:
            pass
        y = torch.ones(2)
        dist.all_reduce(y)
        ck.same("default group after a subgroup failure", y, torch.full((2,), float(world)))
    dist.destroy_process_group(gloo)
    return {**_result(ck), "mismatch_error": mismatch_error}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_work_semantics_like_gloo(world, transport):
    res = run_ranks(_work_semantics, world, backend="pycoll", timeout=50, env={"PYCOLL_TRANSPORT": transport})
    _assert_clean(res)
    if world >= 2:
        # every rank's error names two different sizes: which pair of ranks detects the
        # mismatch first depends on timing, and the others get that report relayed
        errors = [r["mismatch_error"] for r in res]
        sizes = [set(re.findall(r"numel=(\d+)", e)) for e in errors]
        assert all(len(s) >= 2 for s in sizes), errors


# -- point to point ---------------------------------------------------------------------------------
def _p2p(rank: int, world: int) -> dict:
    ck = Checker(rank, world, "p2p")
    gloo = dist.new_group(backend="gloo")
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for group, label in ((None, "pycoll"), (gloo, "gloo")):
        # every dtype, rank r -> r+1, blocking send/recv after posting the receive
        for i, dtype in enumerate(DTYPES):
            out = torch.zeros(7, dtype=dtype)
            req = dist.irecv(out, src=prv, group=group, tag=100 + i)
            dist.send(gen(dtype, 7, seed_of(30, i, rank)), dst=nxt, group=group, tag=100 + i)
            req.wait()
            ck.same(f"{label} send/recv {dtype}", out, gen(dtype, 7, seed_of(30, i, prv)))
        # tags matched out of order; a large message among small ones
        sizes = {1: 3, 2: 300_001, 3: 1}
        sends = [dist.isend(gen(torch.float32, n, seed_of(31, tag, rank)), dst=nxt, group=group, tag=tag)
                 for tag, n in sizes.items()]
        for tag in (3, 2, 1):
            out = torch.zeros(sizes[tag])
            dist.recv(out, src=prv, group=group, tag=tag)
            ck.same(f"{label} recv tag {tag} out of order", out, gen(torch.float32, sizes[tag], seed_of(31, tag, prv)))
        for s in sends:
            s.wait()
        # receive from any source: rank 0 hears from everyone, dist.recv returns the sender
        if rank == 0:
            got = {}
            for _ in range(world - 1):
                out = torch.zeros(2, dtype=torch.int64)
                src = dist.recv(out, group=group, tag=7)
                got[src] = out.tolist()
            ck.same(f"{label} recv(src=None) senders", sorted(got), list(range(1, world)))
            for src, val in got.items():
                if val != [src, src * 10]:
                    ck.fail(f"{label} recv any source", f"from {src} got {val}")
        else:
            dist.send(torch.tensor([rank, rank * 10]), dst=0, group=group, tag=7)
        # batch_isend_irecv: a ring in both directions, several tags
        if world > 1:
            outs = {k: torch.zeros(4, dtype=torch.float64) for k in ("fwd", "bwd")}
            ops = [dist.P2POp(dist.isend, gen(torch.float64, 4, seed_of(32, rank, 0)), nxt, group, tag=1),
                   dist.P2POp(dist.irecv, outs["fwd"], prv, group, tag=1),
                   dist.P2POp(dist.isend, gen(torch.float64, 4, seed_of(32, rank, 1)), prv, group, tag=2),
                   dist.P2POp(dist.irecv, outs["bwd"], nxt, group, tag=2)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            ck.same(f"{label} batch_isend_irecv forward", outs["fwd"], gen(torch.float64, 4, seed_of(32, prv, 0)))
            ck.same(f"{label} batch_isend_irecv backward", outs["bwd"], gen(torch.float64, 4, seed_of(32, nxt, 1)))
    # pycoll only (gloo's blocking send waits for the receiver): a ring of blocking sends,
    # and many isends before any receive is posted
    if world > 1:
        dist.send(torch.full((3,), rank), dst=nxt, tag=40)
        out = torch.zeros(3, dtype=torch.int64)
        dist.recv(out, src=prv, tag=40)
        ck.same("ring of blocking sends", out, torch.full((3,), prv))
        works = [dist.isend(torch.full((5,), rank * 100 + i), dst=nxt, tag=50 + i) for i in range(20)]
        outs = [torch.zeros(5, dtype=torch.int64) for _ in range(20)]
        recvs = [dist.irecv(outs[i], src=prv, tag=50 + i) for i in reversed(range(20))]
        for w in works + recvs:
            w.wait()
        ck.same("20 isends then irecvs in reverse", outs, [torch.full((5,), prv * 100 + i) for i in range(20)])
        w = dist.irecv(torch.zeros(1), src=prv, tag=999)
        if w.is_completed():
            ck.fail("irecv", "completed with no sender")
        try:
            w.wait(timeout=timedelta(milliseconds=50))
            ck.fail("Work.wait(timeout)", "did not raise")
        except RuntimeError:
            pass  # TimeoutError-like; the receive stays posted
        dist.barrier()
        dist.send(torch.ones(1), dst=nxt, tag=999)
        w.wait()
        if w._source_rank() != prv:
            ck.fail("irecv source rank", f"{w._source_rank()} != {prv}")
    dist.destroy_process_group(gloo)
    return _result(ck)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_point_to_point(world):
    _assert_clean(run_ranks(_p2p, world, backend="pycoll", timeout=50))


# -- object collectives ------------------------------------------------------------------------------
def _objects(rank: int, world: int) -> dict:
    ck = Checker(rank, world, "objects")
    gloo = dist.new_group(backend="gloo")

    def obj(r, k=0):
        return {"rank": r, "k": k, "text": "x" * (r * 37 + k), "t": torch.arange(r + 1) * (k + 1), "nested": [r, (k,)]}

    res = {}
    for group, label in ((None, "pycoll"), (gloo, "gloo")):
        out = {}
        for root in range(world):
            lst = [obj(rank, i) for i in range(3)]
            dist.broadcast_object_list(lst, src=root, group=group)
            out[f"broadcast_object_list root={root}"] = lst
            g = [None] * world
            dist.all_gather_object(g, obj(rank, root), group=group)
            out[f"all_gather_object {root}"] = g
            g = [None] * world if rank == root else None
            dist.gather_object(obj(rank, root), g, dst=root, group=group)
            out[f"gather_object root={root}"] = g
            s = [None]
            dist.scatter_object_list(s, [obj(j, root) for j in range(world)] if rank == root else None,
                                     src=root, group=group)
            out[f"scatter_object_list root={root}"] = s
        if world > 1:
            if rank == 0:
                dist.send_object_list([obj(0, 5), "hello", None], dst=world - 1, group=group)
            if rank == world - 1:
                lst = [None, None, None]
                dist.recv_object_list(lst, src=0, group=group)
                out["send/recv_object_list"] = lst
        res[label] = out
    for key, val in res["pycoll"].items():
        if repr(val) != repr(res["gloo"][key]):
            ck.fail(key, f"pycoll {val!r:.200} vs gloo {res['gloo'][key]!r:.200}")
        ck.checks += 1
    if res["pycoll"]["all_gather_object 0"][world - 1]["rank"] != world - 1:
        ck.fail("all_gather_object", "wrong content")
    dist.destroy_process_group(gloo)
    return _result(ck)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 3])
def test_object_collectives_like_gloo(world):
    _assert_clean(run_ranks(_objects, world, backend="pycoll", timeout=50))


# -- subgroups --------------------------------------------------------------------------------------
GROUPS4 = [[0, 1, 2], [1, 2, 3], [0, 3]]


def _subgroups(rank: int, world: int) -> dict:
    ck = Checker(rank, world, "subgroups")
    pgs = [dist.new_group(ranks) for ranks in GROUPS4]              # default backend: pycoll
    ggs = [dist.new_group(ranks, backend="gloo") for ranks in GROUPS4]
    mine = [i for i, ranks in enumerate(GROUPS4) if rank in ranks]
    for i, ranks in enumerate(GROUPS4):
        member = rank in ranks
        if member != (pgs[i] != dist.GroupMember.NON_GROUP_MEMBER):
            ck.fail(f"group {ranks}", "membership wrong")
        if member and (dist.get_rank(pgs[i]) != ranks.index(rank) or dist.get_world_size(pgs[i]) != len(ranks)):
            ck.fail(f"group {ranks}", f"rank/size {dist.get_rank(pgs[i])}/{dist.get_world_size(pgs[i])}")
        if member and dist.get_backend(pgs[i]) != "pycoll":
            ck.fail(f"group {ranks}", f"backend {dist.get_backend(pgs[i])}")

    def round_of(groups, r):
        """Issue async ops on every group of this rank, in a rank- and round-dependent order."""
        order = mine[(rank + r) % len(mine):] + mine[:(rank + r) % len(mine)]
        out = []
        for i in order:
            ranks, g = GROUPS4[i], groups[i]
            x = gen(torch.float64, 6, seed_of(40, i, r, rank))
            b = gen(torch.int32, 4, seed_of(41, i, r, rank))
            a = [torch.zeros(3, dtype=torch.int64) for _ in ranks]
            red = gen(torch.float32, 5, seed_of(42, i, r, rank))
            works = [dist.all_reduce(x, group=g, async_op=True),
                     dist.broadcast(b, src=ranks[r % len(ranks)], group=g, async_op=True),   # global src
                     dist.all_gather(a, torch.full((3,), rank * 10 + r), group=g, async_op=True),
                     dist.reduce(red, dst=ranks[-1], group=g, async_op=True)]
            out.append((i, works, x, b, a, red))
        return out

    for groups, label in ((pgs, "pycoll"), (ggs, "gloo")):
        pending = [round_of(groups, r) for r in range(4)]
        for r, items in reversed(list(enumerate(pending))):   # wait in reverse issue order
            for i, works, x, b, a, red in items:
                for w in reversed(works):
                    w.wait()
                ranks = GROUPS4[i]
                xs = [gen(torch.float64, 6, seed_of(40, i, r, q)) for q in ranks]
                ref, tol = reference(xs, "SUM", len(ranks))
                ck.same(f"{label} group {ranks} round {r} all_reduce", x, ref, tol)
                ck.same(f"{label} group {ranks} round {r} broadcast", b,
                        gen(torch.int32, 4, seed_of(41, i, r, ranks[r % len(ranks)])))
                ck.same(f"{label} group {ranks} round {r} all_gather", a,
                        [torch.full((3,), q * 10 + r) for q in ranks])
                if rank == ranks[-1]:
                    reds = [gen(torch.float32, 5, seed_of(42, i, r, q)) for q in ranks]
                    ref, tol = reference(reds, "SUM", len(ranks))
                    ck.same(f"{label} group {ranks} round {r} reduce", red, ref, tol)
    # gather / scatter / send / recv address peers by global rank inside a subgroup
    g = pgs[1]
    if rank in GROUPS4[1]:
        outs = [torch.zeros(2) for _ in range(3)] if rank == 3 else None
        dist.gather(torch.full((2,), float(rank)), outs, dst=3, group=g)
        if rank == 3:
            ck.same("subgroup gather dst=3", outs, [torch.full((2,), float(q)) for q in GROUPS4[1]])
        o = torch.zeros(2)
        dist.scatter(o, [torch.full((2,), float(q)) for q in GROUPS4[1]] if rank == 2 else None, src=2, group=g)
        ck.same("subgroup scatter src=2", o, torch.full((2,), float(rank)))
        if rank == 1:
            dist.send(torch.tensor([11.0]), dst=3, group=g)
        elif rank == 3:
            o = torch.zeros(1)
            src = dist.recv(o, group=g)
            ck.same("subgroup recv any source", o, torch.tensor([11.0]))
            if src != 1:
                ck.fail("subgroup recv any source", f"returned {src}, expected global rank 1")
    # new_subgroups and the default group still in step
    sub, _ = dist.new_subgroups(group_size=2)
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=sub)
    ck.same("new_subgroups(2) all_reduce", y, torch.tensor([float(rank // 2 * 4 + 1)]))
    z = torch.ones(1)
    dist.all_reduce(z)
    ck.same("default group after subgroups", z, torch.tensor([4.0]))
    return _result(ck)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_overlapping_subgroups_interleaved(transport):
    _assert_clean(run_ranks(_subgroups, 4, backend="pycoll", timeout=50, env={"PYCOLL_TRANSPORT": transport}))


# -- monitored barrier ---------------------------------------------------------------------------
def _monitored(rank: int, world: int, absent: list[int], wait_all: bool) -> dict:
    import pycoll

    ck = Checker(rank, world, "monitored_barrier")
    pycoll.monitored_barrier(timeout=timedelta(seconds=5))          # everyone arrives
    pycoll.monitored_barrier(None, timedelta(seconds=5), True)
    err = None
    if rank not in absent:
        try:
            pycoll.monitored_barrier(timeout=timedelta(milliseconds=400), wait_all_ranks=wait_all)
            ck.fail("monitored_barrier", "did not raise although a rank is absent")
        except RuntimeError as exc:
            err = str(exc)
    named = absent if wait_all else absent[:1]
    if rank == 0:
        for r in named:
            if err is None or f"{r}" not in err.split("failed")[0]:
                ck.fail("monitored_barrier", f"error does not name rank {r}: {err}")
        if err is not None and ("monitoredBarrier" not in err or ("Ranks" in err) != (len(named) > 1)):
            ck.fail("monitored_barrier", f"unexpected message: {err}")
    dist.barrier()  # the group still works
    return {"fails": ck.fails, "checks": ck.checks + 1, "err": err}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,absent,wait_all", [(3, [2], False), (4, [2, 3], True), (4, [1, 3], False)])
def test_monitored_barrier_names_absent_ranks(world, absent, wait_all):
    res = run_ranks(_monitored, world, absent, wait_all, backend="pycoll", timeout=50)
    _assert_clean(res)
    assert "failed to pass monitoredBarrier" in res[0]["err"]


# -- bad input: rejected on the calling rank, before any communication -------------------------------
def _bad_inputs(rank: int, world: int) -> dict:
    ck = Checker(rank, world, "bad input")
    f, i64 = torch.ones(4), torch.ones(4, dtype=torch.int64)
    W = world
    cases = {
        "all_gather output dtype differs": lambda g: dist.all_gather([torch.zeros(4, dtype=torch.int64)] * W, f, group=g),
        "all_gather output list too short": lambda g: dist.all_gather([torch.zeros(4)] * (W - 1), f, group=g),
        "all_gather output size differs": lambda g: dist.all_gather([torch.zeros(5)] * W, f, group=g),
        "all_gather_into_tensor size": lambda g: dist.all_gather_into_tensor(torch.zeros(4 * W + 1), f, group=g),
        "all_gather_into_tensor dtype": lambda g: dist.all_gather_into_tensor(torch.zeros(4 * W, dtype=torch.int64), f, group=g),
        "all_reduce_coalesced mixed dtypes": lambda g: dist.all_reduce_coalesced([f.clone(), i64.clone()], group=g),
        "all_gather_coalesced length": lambda g: dist.all_gather_coalesced([[torch.zeros(4)]] * (W + 1), [f], group=g),
        "reduce_scatter list length": lambda g: dist.reduce_scatter(torch.zeros(4), [f] * (W + 1), group=g),
        "reduce_scatter dtype mix": lambda g: dist.reduce_scatter(torch.zeros(4), [i64] * W, group=g),
        "reduce_scatter_tensor size": lambda g: dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * W + 2), group=g),
        "all_to_all_single splits sum": lambda g: dist.all_to_all_single(torch.zeros(2 * W), torch.ones(2 * W),
                                                                        [2] * W, [1] * W, group=g),
        "all_to_all_single splits length": lambda g: dist.all_to_all_single(torch.zeros(2 * W), torch.ones(2 * W),
                                                                           [2] * (W + 1), [2] * (W + 1), group=g),
        "all_to_all_single not divisible": lambda g: dist.all_to_all_single(torch.zeros(W + 1), torch.ones(W + 1), group=g),
        "all_to_all list length": lambda g: dist.all_to_all([torch.zeros(1)] * (W + 1), [torch.ones(1)] * (W + 1), group=g),
        "all_to_all dtype mix": lambda g: dist.all_to_all([torch.zeros(1)] * W, [torch.ones(1, dtype=torch.int64)] * W, group=g),
        "broadcast root out of range": lambda g: dist.broadcast(f.clone(), src=W, group=g),
        "reduce root out of range": lambda g: dist.reduce(f.clone(), dst=W + 3, group=g),
        "scatter list length": lambda g: dist.scatter(torch.zeros(4), [f] * (W + 1), src=0, group=g),
        "gather list length": lambda g: dist.gather(f, [torch.zeros(4)] * (W + 1), dst=0, group=g),
        "scatter part size": lambda g: dist.scatter(torch.zeros(4), [torch.ones(3)] * W, src=0, group=g),
        "send peer out of range": lambda g: dist.send(f, dst=W, group=g),
        "recv peer out of range": lambda g: dist.recv(f.clone(), src=W + 1, group=g),
        "send to self": lambda g: dist.send(f, dst=0, group=g),
        "sparse all_reduce MAX": lambda g: dist.all_reduce(torch.eye(3).to_sparse(), op=dist.ReduceOp.MAX, group=g),
        "sparse broadcast": lambda g: dist.broadcast(torch.eye(3).to_sparse(), src=0, group=g),
        "BAND on float": lambda g: dist.all_reduce(f.clone(), op=dist.ReduceOp.BAND, group=g),
        "PREMUL_SUM on int": lambda g: dist.all_reduce(i64.clone(), op=dist._make_nccl_premul_sum(2.0), group=g),
        "AVG on bool": lambda g: dist.all_reduce(torch.ones(2, dtype=BOOL), op=dist.ReduceOp.AVG, group=g),
        "MAX on complex": lambda g: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX, group=g),
        "unsupported dtype": lambda g: dist.all_reduce(torch.ones(2, dtype=torch.uint16), group=g),
    }
    summary = {}
    if rank == 0:
        for name, call in cases.items():
            exc = ck.raises(name, (ValueError, TypeError, RuntimeError), lambda: call(None))
            # (no gloo comparison here: gloo aborts the process on some of these, e.g. a
            # reduce_scatter_tensor size mismatch is a fatal CHECK in ProcessGroupGloo.cpp)
            summary[name] = (type(exc).__name__ if exc is not None else "accepted", str(exc)[:100])
            if isinstance(exc, CommError):
                ck.fail(name, f"communication error instead of an argument error: {exc!r}")
    # nobody communicated: every rank's next collective is still in step
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    ck.same("all_reduce after rejected calls", t, torch.full((3,), float(sum(range(world)))))
    return {"fails": ck.fails, "checks": ck.checks, "summary": summary}


@pytest.mark.timeout(60)
def test_bad_input_rejected_before_communication():
    res = run_ranks(_bad_inputs, 2, backend="pycoll", timeout=50)
    _assert_clean(res)


# -- non-contiguous tensors: gloo rejects most of them, pycoll must get them right ---------------------
def _noncontig(rank: int, world: int) -> dict:
    ck = Checker(rank, world, "non-contiguous")

    def nc(seed, rows=4, cols=3, dtype=torch.float64):
        """A transposed (cols x rows) view; its data is gen(rows x cols).t()."""
        return gen(dtype, (rows, cols), seed).t()

    x = nc(seed_of(50, rank))
    dist.all_reduce(x)
    ref, tol = reference([nc(seed_of(50, q)) for q in range(world)], "SUM", world)
    ck.same("all_reduce", x, ref, tol)
    if x.is_contiguous():
        ck.fail("setup", "tensor is contiguous")
    x = nc(seed_of(51, rank), dtype=torch.int32)
    dist.broadcast(x, src=world - 1)
    ck.same("broadcast", x, nc(seed_of(51, world - 1), dtype=torch.int32))
    x = nc(seed_of(52, rank))
    dist.reduce(x, dst=0)
    if rank == 0:
        ck.same("reduce", x, *reference([nc(seed_of(52, q)) for q in range(world)], "SUM", world))
    else:
        ck.same("reduce non-root untouched", x, nc(seed_of(52, rank)))
    outs = [torch.zeros(4, 3, dtype=torch.float64).t() for _ in range(world)]
    dist.all_gather(outs, nc(seed_of(53, rank)))
    ck.same("all_gather", outs, [nc(seed_of(53, q)) for q in range(world)])
    out = torch.zeros(3, 4 * world, dtype=torch.float64)[:, ::1].t()   # (4W x 3) transposed view
    dist.all_gather_into_tensor(out, torch.ones(4, 3, dtype=torch.float64) * rank)
    ck.same("all_gather_into_tensor", out, torch.cat([torch.ones(4, 3, dtype=torch.float64) * q for q in range(world)]))
    out = torch.zeros(3, 4, dtype=torch.float64).t()
    inp = gen(torch.float64, (3, 4 * world), seed_of(54, rank)).t()
    dist.reduce_scatter_tensor(out, inp)
    ins = [gen(torch.float64, (3, 4 * world), seed_of(54, q)).t() for q in range(world)]
    ck.same("reduce_scatter_tensor", out, *reference([i[4 * rank:4 * rank + 4] for i in ins], "SUM", world))
    out = torch.zeros(4, 3, dtype=torch.float64).t()
    dist.scatter(out, [nc(seed_of(55, j)) for j in range(world)] if rank == 0 else None, src=0)
    ck.same("scatter", out, nc(seed_of(55, rank)))
    outs = [torch.zeros(4, 3, dtype=torch.float64).t() for _ in range(world)] if rank == 0 else None
    dist.gather(nc(seed_of(56, rank)), outs, dst=0)
    if rank == 0:
        ck.same("gather", outs, [nc(seed_of(56, q)) for q in range(world)])
    inp = gen(torch.float32, (2, 2 * world), seed_of(57, rank)).t()     # (2W x 2), rows go out in pairs
    out = torch.zeros(2, 2 * world).t()
    dist.all_to_all_single(out, inp)
    ck.same("all_to_all_single", out, torch.cat([gen(torch.float32, (2, 2 * world), seed_of(57, q)).t()[2 * rank:2 * rank + 2]
                                                 for q in range(world)]))
    if world > 1:
        out = torch.zeros(4, 3, dtype=torch.float64).t()
        w = dist.irecv(out, src=(rank - 1) % world, tag=5)
        dist.send(nc(seed_of(58, rank)), dst=(rank + 1) % world, tag=5)
        w.wait()
        ck.same("send/recv", out, nc(seed_of(58, (rank - 1) % world)))
    t = gen(torch.float32, (6, 4), seed_of(59, rank))[::2, 1:3]         # strided slice
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ck.same("all_reduce strided slice MAX", t, *reference(
        [gen(torch.float32, (6, 4), seed_of(59, q))[::2, 1:3] for q in range(world)], "MAX", world))
    return _result(ck)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [1, 3])
def test_non_contiguous_tensors(world, transport):
    _assert_clean(run_ranks(_noncontig, world, backend="pycoll", timeout=50, env={"PYCOLL_TRANSPORT": transport}))


# -- parameters, 0-dim tensors, PREMUL_SUM with a tensor factor, Work.wait(timeout) ------------------
def _misc(rank: int, world: int) -> dict:
    import time

    ck = Checker(rank, world, "misc")
    gloo = dist.new_group(backend="gloo")
    res = {}
    for group, label in ((None, "pycoll"), (gloo, "gloo")):
        r = res[label] = {}
        # leaf parameters that require grad, written in place (the usual param sync loop)
        p = torch.nn.Parameter(gen(torch.float32, 6, seed_of(60, rank)))
        dist.broadcast(p, src=world - 1, group=group)
        r["param broadcast"] = p.detach().clone()
        dist.all_reduce(p, group=group)
        r["param all_reduce"] = p.detach().clone()
        outs = [torch.zeros(6) for _ in range(world)]
        dist.all_gather(outs, p, group=group)
        r["param all_gather input"] = outs
        # 0-dim tensors
        s = torch.tensor(float(rank + 1))
        dist.all_reduce(s, op=dist.ReduceOp.MAX, group=group)
        r["0-dim all_reduce"] = s
        s = torch.tensor(rank * 3 + 1)
        dist.broadcast(s, src=0, group=group)
        r["0-dim broadcast"] = s
        outs = [torch.tensor(0.0) for _ in range(world)]
        dist.all_gather(outs, torch.tensor(float(rank)), group=group)
        r["0-dim all_gather"] = outs
        # Work.wait(timeout) on a collective whose peer is late raises on time; a later
        # wait() still completes the op
        if world > 1:
            if rank == world - 1:
                time.sleep(0.6)
            t0 = time.perf_counter()
            w = dist.all_reduce(torch.ones(2), group=group, async_op=True)
            raised = False
            try:
                w.wait(timeout=timedelta(milliseconds=150))
            except RuntimeError:
                raised = True
            took = time.perf_counter() - t0
            if rank != world - 1 and (not raised or took > 0.5):
                ck.fail(f"{label} Work.wait(timeout)", f"raised={raised} after {took:.2f} s (peer 0.6 s late)")
            w.wait()
            dist.barrier(group=group)
    ck.same("pycoll vs gloo", [res["pycoll"][k] for k in res["gloo"]], list(res["gloo"].values()), "approx")
    x = gen(torch.float64, 5, seed_of(61, rank))
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(torch.tensor(0.25, dtype=torch.float64)))
    ref = sum(gen(torch.float64, 5, seed_of(61, q)) * 0.25 for q in range(world))
    ck.same("PREMUL_SUM with a tensor factor", x, ref, "approx")
    dist.destroy_process_group(gloo)
    return _result(ck)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [1, 2])
def test_params_scalars_wait_timeout_like_gloo(world, transport):
    _assert_clean(run_ranks(_misc, world, backend="pycoll", timeout=50, env={"PYCOLL_TRANSPORT": transport}))
