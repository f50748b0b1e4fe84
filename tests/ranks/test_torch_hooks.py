"""torch's per-op hooks on pycoll groups: the Flight Recorder (torch >= 2.15 attaches it to
every new group), its analyzer, pycoll's hang dump beside it, and users' pre/post hooks.

pycoll's op methods are Python; torch's hooks run in its C++ ProcessGroup. A hooked group
sends its ops through a C++ ProcessGroup of its own (``pycoll.c10d.dispatch``): these tests
check what torch's tools then see, against gloo where gloo records the same.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from pycoll.c10d import dispatch
from pycoll.testing.ranks import run_ranks

C10D = torch._C._distributed_c10d
RECORDS = hasattr(c10d, "_maybe_attach_flight_recorder")   # torch attaches the recorder itself
needs_recorder = pytest.mark.skipif(not RECORDS, reason="torch attaches no Flight Recorder before 2.15")
needs_hooks = pytest.mark.skipif(not (hasattr(dist.ProcessGroup, "register_pre_hook") and dispatch.backend_supported()),
                                 reason="this torch has no ProcessGroup hooks or no Python c10d Backend")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _entries(backend: str) -> list[dict]:
    return pickle.loads(C10D._dump_fr_trace(backend=backend))["entries"]


def _recorded_ops(rank, world, backend):
    C10D._reset_fr_trace(backend=backend)
    t = torch.arange(6, dtype=torch.float64) + rank
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    out = torch.empty(6 * world, dtype=torch.float64)
    dist.all_gather_into_tensor(out, t)
    rs = torch.empty(3, dtype=torch.int32)
    dist.reduce_scatter_tensor(rs, torch.ones(3 * world, dtype=torch.int32))
    w = dist.all_reduce(torch.ones(2, dtype=torch.bfloat16), async_op=True)
    w.wait()
    dist.barrier()
    if rank == 0:
        dist.send(torch.ones(5), 1, tag=3)
    elif rank == 1:
        dist.recv(torch.zeros(5), 0, tag=3)
    keep = ("profiling_name", "collective_seq_id", "input_sizes", "input_dtypes", "output_sizes",
            "output_dtypes", "process_group", "is_p2p", "state")
    return {"entries": [{k: e[k] for k in keep} for e in _entries(backend)],
            "work_type": type(w).__module__, "completed": w.is_completed()}


@needs_recorder
def test_the_flight_recorder_sees_pycolls_collectives_as_it_sees_glooss():
    gloo = run_ranks(_recorded_ops, 2, "gloo", backend="gloo")
    ours = run_ranks(_recorded_ops, 2, "pycoll", backend="pycoll")
    # torch's hook names the tensor forms after c10d's methods; gloo's own recorder calls
    # all_gather_into_tensor "all_gather" and runs reduce_scatter_tensor as an all_reduce.
    as_gloo = {"_all_gather_base": "all_gather", "_reduce_scatter_base": "all_reduce"}
    same = ("collective_seq_id", "input_sizes", "input_dtypes", "output_dtypes", "process_group", "state")
    for g, p in zip(gloo, ours):
        collectives = [e for e in p["entries"] if not e["is_p2p"]]
        names = [e["profiling_name"].split(":", 1) for e in collectives]
        assert {n[0] for n in names} == {"pycoll"}
        assert [as_gloo.get(n[1], n[1]) for n in names] == [e["profiling_name"].split(":", 1)[1] for e in g["entries"]]
        assert [{k: e[k] for k in same} for e in collectives] == [{k: e[k] for k in same} for e in g["entries"]]
        assert [e["collective_seq_id"] for e in collectives] == list(range(1, 7))
        # The caller still gets pycoll's own Work through torch's path.
        assert p["work_type"] == "pycoll.core.work" and p["completed"]
    # gloo records no point-to-point op; pycoll's go to the recorder as NCCL's do.
    assert [e["profiling_name"] for e in ours[0]["entries"] if e["is_p2p"]] == ["pycoll:send 0->1"]
    assert [e["profiling_name"] for e in ours[1]["entries"] if e["is_p2p"]] == ["pycoll:recv 1<-0"]


def _one_rank_never_arrives(rank, world, folder, missing):
    C10D._reset_fr_trace(backend="pycoll")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    sub = dist.new_group(list(range(world)))
    dist.all_reduce(t, group=sub)
    work = None
    if rank != missing:
        work = dist.all_reduce(t, async_op=True)     # the missing rank never calls it
    with open(os.path.join(folder, f"rank_{rank}"), "wb") as f:
        f.write(C10D._dump_fr_trace(backend="pycoll"))
    from pycoll.observe import hangdump

    comm = c10d._get_default_group().communicator
    deadline = time.monotonic() + 10
    while rank != missing and comm.current is None and time.monotonic() < deadline:
        time.sleep(0.005)    # the group's thread takes the async op up
    lines = hangdump.dump("test") if rank != missing else []
    entries = _entries("pycoll")
    dist.barrier(group=sub)      # every dump is written before the missing rank arrives
    if rank == missing:
        dist.all_reduce(t)       # it arrives at last: the others' op completes
    else:
        work.wait()
    return {"dump": lines, "last": entries[-1]["collective_seq_id"], "pg": entries[-1]["process_group"]}


@needs_recorder
def test_torchs_analyzer_names_the_rank_that_never_arrived_and_the_hang_dump_agrees(tmp_path):
    world, missing = 3, 2
    res = run_ranks(_one_rank_never_arrives, world, str(tmp_path), missing, backend="pycoll")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    assert f"missing ranks: {{{missing}}}" in report, report
    assert "collective: pycoll:all_reduce" in report, report
    for rank in range(world):
        if rank == missing:
            continue
        # The hang dump names the pending all_reduce by pycoll's sequence number and by the
        # recorder's collective_seq_id, which the dump's last entry carries.
        pending = [line for line in res[rank]["dump"] if "in all_reduce" in line]
        assert pending, res[rank]["dump"]
        assert f"Flight Recorder collective_seq_id {res[rank]['last']}" in pending[0], pending


def _user_hooks(rank, world):
    pg = c10d._get_default_group()
    seen = []
    pg.register_pre_hook(7, lambda a: seen.append(("pre", str(a.name), [tuple(x.shape) for x in a.input_tensors])))
    pg.register_post_hook(7, lambda a: seen.append(("post", str(a.name))))
    dist.all_reduce(torch.ones(3))
    dist.broadcast(torch.ones(2), 0)
    dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))
    return seen


@needs_hooks
def test_a_users_pre_and_post_hooks_see_every_op_as_on_gloo():
    gloo = run_ranks(_user_hooks, 2, backend="gloo")
    ours = run_ranks(_user_hooks, 2, backend="pycoll")
    assert ours == gloo
    pre = [s[1] for s in ours[0] if s[0] == "pre"]   # (2.14 calls the tensor all_gather ALLGATHER)
    assert pre[:2] == ["HookOpName.ALLREDUCE", "HookOpName.BROADCAST"] and pre[2].startswith("HookOpName.ALLGATHER")


def _nan_check(rank, world):
    t = torch.ones(3)
    t[1] = float("nan")     # on every rank: each refuses before any communication
    try:
        dist.all_reduce(t)
    except RuntimeError as exc:
        return str(exc)
    return None


@needs_recorder
def test_torchs_nan_check_hook_works_on_pycoll_as_on_gloo():
    env = {"TORCH_DIST_NAN_CHECK": "1"}
    gloo = run_ranks(_nan_check, 2, backend="gloo", env=env)
    ours = run_ranks(_nan_check, 2, backend="pycoll", env=env)
    assert gloo[0] is not None and "nan" in gloo[0].lower()
    assert ours == gloo
