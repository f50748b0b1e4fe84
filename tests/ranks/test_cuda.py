"""CUDA tensors: path choice, the torch -> NCCL table, messages, registration, the IPC algorithms.

What runs where:
- everywhere (CPU build included): the pure path choice, the dtype/op table, the error
  messages, backend registration, the plan primitives every path must have, and the IPC path's algorithms on a
  host-memory stand-in (real processes, real ShmArena barriers and signature checks; only the
  device buffers and CUDA events are replaced by shared host memory and no-ops);
- with a GPU (skipped otherwise): every collective on CUDA tensors through each path
  (staging and ipc with 2-3 processes sharing GPU 0, nccl with one rank per GPU), Work and
  future semantics, mismatch detection on ipc, the forced-path errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pycoll
from pycoll.core.reductions import make_reduction
from pycoll.cuda import dtypes
from pycoll.cuda.ipc import IpcPath
from pycoll.cuda.paths import (
    CudaPathError,
    RankFacts,
    backend_devices,
    choose_path,
    cuda_hint,
    explain,
    requested_path,
)
from pycoll.shm.arena import ShmArena
from pycoll.testing.ranks import rank_store, run_ranks

pytestmark = pytest.mark.timeout(300)

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tools/gpu_check.sh)")


# -- path choice (pure) ---------------------------------------------------------------------------
def facts(ranks: int, ranks_per_host: int, gpus_per_host: int, cupy: bool = True, env: str = "auto",
          visible_all: bool = True) -> list[RankFacts]:
    """``ranks`` ranks, ``ranks_per_host`` on each host, spread round-robin over its GPUs."""
    out = []
    for r in range(ranks):
        host, local = divmod(r, ranks_per_host)
        gpus = [f"GPU-{host}-{g}" for g in range(gpus_per_host)]
        gpu = gpus[local % gpus_per_host]
        out.append(RankFacts(f"host{host}", gpu, tuple(gpus) if visible_all else (gpu,), cupy, cupy, env))
    return out


@pytest.mark.parametrize("ranks,per_host,gpus,cupy,expected", [
    (2, 2, 2, True, "nccl"),        # one host, one GPU each
    (4, 2, 2, True, "nccl"),        # two hosts, one GPU per rank
    (1, 1, 1, True, "nccl"),
    (2, 2, 1, True, "ipc"),         # two ranks share one GPU: NCCL refuses, IPC works
    (4, 4, 2, True, "ipc"),
    (2, 2, 2, False, "ipc"),        # no cupy: IPC needs none
    (1, 1, 1, False, "ipc"),
    (4, 2, 1, True, "staging"),     # two hosts, ranks sharing a GPU on each
    (4, 2, 2, False, "staging"),    # two hosts, no cupy
])
def test_auto_path(ranks, per_host, gpus, cupy, expected):
    assert choose_path(facts(ranks, per_host, gpus, cupy)) == expected


def test_forced_paths():
    assert choose_path(facts(4, 2, 1, cupy=False, env="staging")) == "staging"
    assert choose_path(facts(2, 2, 2, env="ipc")) == "ipc"
    assert choose_path(facts(2, 2, 2, env="nccl")) == "nccl"
    with pytest.raises(CudaPathError) as e:
        choose_path(facts(2, 2, 2, cupy=False, env="nccl"))
    assert "pycoll[cuda]" in str(e.value) and "rank(s) 0, 1" in str(e.value)
    with pytest.raises(CudaPathError) as e:
        choose_path(facts(2, 2, 1, env="nccl"))
    assert "same GPU" in str(e.value) and "pycoll[cuda]" not in str(e.value)
    with pytest.raises(CudaPathError, match="span 2 hosts"):
        choose_path(facts(4, 2, 2, env="ipc"))
    with pytest.raises(CudaPathError, match="cannot see"):
        choose_path(facts(2, 2, 2, cupy=False, env="ipc", visible_all=False))
    # hidden GPUs also keep auto off ipc
    assert choose_path(facts(2, 2, 2, cupy=False, visible_all=False)) == "staging"


def test_ranks_must_agree_on_the_request():
    fs = facts(2, 2, 1)
    fs[1] = RankFacts(fs[1].host, fs[1].gpu, fs[1].visible, True, True, "staging")
    with pytest.raises(CudaPathError, match="differs between ranks"):
        choose_path(fs)


def test_requested_path_env():
    assert requested_path({}) == "auto"
    assert requested_path({"PYCOLL_CUDA_PATH": " IPC "}) == "ipc"
    with pytest.raises(ValueError, match="auto, nccl, ipc, staging"):
        requested_path({"PYCOLL_CUDA_PATH": "mpi"})


def test_facts_round_trip_and_explain():
    f = facts(2, 2, 1)[1]
    assert RankFacts.from_json(f.to_json()) == f
    assert explain(facts(2, 2, 1)).startswith("ipc (not nccl: ranks 0 and 1 share GPU")
    assert explain(facts(2, 2, 2)) == "nccl"
    assert explain(facts(2, 2, 2, cupy=False, env="nccl")).startswith("error: ")


# -- messages --------------------------------------------------------------------------------------
def test_messages_name_the_extra():
    msg = cuda_hint("all_reduce")
    assert msg.startswith("all_reduce: ") and "pip install 'pycoll[cuda]'" in msg
    assert "PYCOLL_CUDA_PATH=staging" in msg


# -- the torch -> NCCL table -------------------------------------------------------------------------
NEW, OLD = 22703, 2805  # NCCL 2.27.3, 2.8.5 (codes before 2.9 are X*1000 + Y*100 + Z)


@pytest.mark.parametrize("dtype,name", [
    (torch.int8, "ncclInt8"), (torch.uint8, "ncclUint8"), (torch.int32, "ncclInt32"), (torch.int64, "ncclInt64"),
    (torch.float16, "ncclFloat16"), (torch.bfloat16, "ncclBfloat16"), (torch.float32, "ncclFloat32"),
    (torch.float64, "ncclFloat64"), (torch.bool, "ncclUint8"), (torch.complex64, "ncclFloat32"),
    (torch.complex128, "ncclFloat64"),
])
def test_nccl_dtype_table(dtype, name):
    nr = dtypes.nccl_reduction(dtype, "sum", NEW)
    assert dtypes.NAMES[nr.datatype] == name
    assert nr.as_real == dtype.is_complex
    assert dtypes.OP_NAMES[nr.op] == ("ncclMax" if dtype is torch.bool else "ncclSum")


def test_nccl_enum_values_are_ncclh():
    # nccl.h: ncclInt8=0 ... ncclFloat64=8, ncclBfloat16=9; ncclSum=0, ncclProd=1, ncclMax=2, ncclMin=3, ncclAvg=4
    assert (dtypes.INT8, dtypes.UINT8, dtypes.INT32, dtypes.UINT32, dtypes.INT64, dtypes.UINT64, dtypes.FLOAT16, dtypes.FLOAT32, dtypes.FLOAT64,
            dtypes.BFLOAT16) == tuple(range(10))
    assert (dtypes.SUM, dtypes.PROD, dtypes.MAX, dtypes.MIN, dtypes.AVG) == (0, 1, 2, 3, 4)


def test_nccl_ops():
    assert dtypes.nccl_reduction(torch.float32, "avg", NEW) == dtypes.NcclReduction(dtypes.FLOAT32, dtypes.AVG, False, False)
    assert dtypes.nccl_reduction(torch.float32, "avg", OLD) == dtypes.NcclReduction(dtypes.FLOAT32, dtypes.SUM, False, True)
    assert dtypes.nccl_reduction(torch.int64, "avg", NEW) == dtypes.NcclReduction(dtypes.INT64, dtypes.SUM, False, True)
    assert dtypes.nccl_reduction(torch.complex64, "avg", NEW) == dtypes.NcclReduction(dtypes.FLOAT32, dtypes.SUM, True, True)
    assert dtypes.nccl_reduction(torch.float16, "premul_sum", NEW).op == dtypes.SUM
    assert [dtypes.nccl_reduction(torch.bool, o, NEW).op for o in ("sum", "max", "product", "min")] == \
        [dtypes.MAX, dtypes.MAX, dtypes.MIN, dtypes.MIN]
    assert dtypes.nccl_reduction(torch.int32, "product", NEW).op == dtypes.PROD
    for dtype, op in ((torch.int16, "sum"), (torch.int32, "band"), (torch.bool, "bxor"),
                      (torch.complex64, "max"), (torch.complex128, "product")):
        with pytest.raises(dtypes.NcclUnsupported):
            dtypes.nccl_reduction(dtype, op, NEW)
    with pytest.raises(ValueError, match="NCCL >= 2.10"):
        dtypes.nccl_reduction(torch.bfloat16, "sum", OLD)
    assert dtypes.fmt_version(NEW) == "2.27.3" and dtypes.fmt_version(OLD) == "2.8.5"


def test_cupy_constants_are_checked():
    class Fake:
        NCCL_FLOAT32, NCCL_SUM, NCCL_AVG = 7, 0, 4
    dtypes.check_cupy_constants(Fake)
    Fake.NCCL_AVG = 5
    with pytest.raises(RuntimeError, match="NCCL_AVG"):
        dtypes.check_cupy_constants(Fake)


# -- registration and dispatch -------------------------------------------------------------------------
def test_backend_devices():
    assert backend_devices(True) == ["cpu", "cuda"]
    assert backend_devices(False) == ["cpu"]
    assert dist.Backend.backend_capability["pycoll"] == backend_devices(torch.version.cuda is not None)


def _registered_with_cuda(rank, world):
    name = "pycoll_cudareg"
    if name.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(name, pycoll.create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(name, rank=rank, world_size=world, store=rank_store())
    try:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        objs = [None] * world
        dist.all_gather_object(objs, {"r": rank})
        dist.barrier()
        return t.tolist(), objs, dist.Backend.backend_capability[name]
    finally:
        dist.destroy_process_group()


def test_c10d_accepts_a_cuda_device_list_on_any_build():
    """Registering ["cpu", "cuda"] is harmless on a CPU-only torch: CPU collectives and object
    collectives still work (pycoll registers "cuda" on CUDA builds only, all the same)."""
    res = run_ranks(_registered_with_cuda, 2, timeout=60)
    assert [r[0] for r in res] == [[3.0] * 3] * 2
    assert res[0][1] == [{"r": 0}, {"r": 1}] and res[0][2] == ["cpu", "cuda"]


def _cpu_calls_make_no_cuda_channel(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_gather_into_tensor(torch.zeros(8), t)
    dist.barrier()
    return pg._cuda is None


def test_cpu_calls_make_no_cuda_channel():
    assert run_ranks(_cpu_calls_make_no_cuda_channel, 2, backend="pycoll") == [True, True]
    from pycoll.c10d.backend import ProcessGroupPycoll
    impl = getattr(ProcessGroupPycoll.all_gather_single, "impl", ProcessGroupPycoll.all_gather_single)
    assert getattr(ProcessGroupPycoll._allgather_base, "impl", ProcessGroupPycoll._allgather_base) is impl


def test_every_plan_primitive_is_a_method_of_every_cuda_path():
    """The CUDA channel calls a path's method named after the plan's primitive: the names
    of plans.py and of the nccl and ipc paths must agree (the staging path runs the CPU call)."""
    import ast
    from pathlib import Path

    from pycoll.c10d import cpu
    from pycoll.cuda.nccl import NcclPath

    ops = {op for op in cpu.PRIMITIVES if op != "sparse_all_reduce"} | {"send", "recv"}
    plans_src = Path(cpu.__file__).with_name("plans.py").read_text()
    made = {node.args[0].value for node in ast.walk(ast.parse(plans_src))
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Plan"
            and node.args and isinstance(node.args[0], ast.Constant)}
    assert made - {"sparse_all_reduce"} <= ops, made
    for path in (NcclPath, IpcPath):
        missing = {op for op in ops if not callable(getattr(path, op, None))}
        assert missing <= ({"send", "recv"} if path is IpcPath else set()), (path.__name__, missing)


# -- the IPC algorithms on a host-memory stand-in ---------------------------------------------------
class HostIpc(IpcPath):
    """IpcPath with its slots in a host ShmArena and the CUDA events as no-ops.

    On the host every copy finishes before the next barrier, so the barriers alone order the
    ranks; what this checks is the rest: rounds, slot regions, parities, counts, reductions,
    signature checks and the all_to_all round agreement.
    """

    def _setup(self, store, facts) -> None:
        self.slots = ShmArena(store, "hostipc/slots", self.rank, self.world, list(range(self.world)),
                              self.timeout, slot_bytes=2 * self.slot)
        for q in range(self.world):
            self.bufs[q] = self.slots.slot(q, 0)

    def _record(self, kind, p):
        pass

    def _wait(self, q, kind, p):
        pass

    def _device_sync(self):
        pass


def _inp(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.int64) % 5 + rank + 1
    return (x % 2 == 0) if dtype is torch.bool else x.to(dtype)


def _ipc_battery(rank, world, dtype=torch.float32):
    world_ranks = range(world)
    path = HostIpc(dist.PrefixStore("emu", rank_store()), rank, world, torch.device("cpu"), 60.0, None)
    checked = 0
    for n in (0, 1, 1000, 40_000, 70_001):       # 64 KiB slots: up to 5 rounds; > 256 KiB: two-phase
        ins = [_inp(r, n, dtype) for r in world_ranks]
        for op in ("sum", "max", "avg", "product"):
            red = make_reduction(op, dtype, world)
            t = ins[rank].clone()
            path.all_reduce(t, red)
            ref = {"sum": sum(ins[1:], ins[0].clone()), "max": torch.stack(ins).amax(0),
                   "product": torch.stack(ins).prod(0)}.get(op)
            if op == "avg":
                ref = sum(ins[1:], ins[0].clone()) / world
            torch.testing.assert_close(t, ref.to(dtype), msg=f"all_reduce {op} n={n}")
            checked += 1
        root = world - 1
        t = ins[rank].clone()
        path.reduce(t, root, make_reduction("sum", dtype, world))
        torch.testing.assert_close(t, sum(ins[1:], ins[0].clone()) if rank == root else ins[rank])
        t = ins[rank].clone()
        path.broadcast(t, 0)
        torch.testing.assert_close(t, ins[0])
        out = torch.empty(n * world, dtype=dtype)
        path.all_gather(out, ins[rank])
        torch.testing.assert_close(out, torch.cat(ins))
        out = torch.zeros(n * world, dtype=dtype)
        path.gather(out if rank == root else None, ins[rank], root)
        if rank == root:
            torch.testing.assert_close(out, torch.cat(ins))
        out = torch.empty(n, dtype=dtype)
        path.scatter(out, torch.cat(ins) if rank == 1 % world else None, 1 % world)
        torch.testing.assert_close(out, ins[rank])
        # reduce_scatter with uneven blocks: block q holds q + n // world elements
        counts = tuple(q + n // world for q in world_ranks)
        full = [_inp(r, sum(counts), dtype) for r in world_ranks]
        out = torch.empty(counts[rank], dtype=dtype)
        path.reduce_scatter(out, full[rank].clone(), counts, make_reduction("sum", dtype, world))
        lo = sum(counts[:rank])
        torch.testing.assert_close(out, sum(f[lo:lo + counts[rank]] for f in full))
        # all_to_all: rank s sends (s + d + n) % 7 * 9000 elements to rank d (some rounds, some zero)
        sc = tuple((rank + d + n) % 7 * 9000 * (n > 0) for d in world_ranks)
        rc = tuple((s + rank + n) % 7 * 9000 * (n > 0) for s in world_ranks)
        send = torch.cat([torch.full((c,), rank * 100 + d, dtype=dtype) for d, c in enumerate(sc)])
        recv = torch.empty(sum(rc), dtype=dtype)
        path.all_to_all(recv, send, sc, rc)
        torch.testing.assert_close(recv, torch.cat([torch.full((c,), s * 100 + rank, dtype=dtype)
                                                    for s, c in enumerate(rc)]))
        checked += 1
    path.barrier()
    path.close()
    path.slots.close()
    return checked


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ipc_algorithms_on_host_memory(world):
    res = run_ranks(_ipc_battery, world, timeout=240, env={"PYCOLL_CUDA_IPC_SLOT_BYTES": "65536"})
    assert res == [25] * world


def _ipc_mismatch(rank, world):
    path = HostIpc(dist.PrefixStore("emu", rank_store()), rank, world, torch.device("cpu"), 20.0, None)
    t = torch.ones(4 + rank)
    try:
        path.all_reduce(t, make_reduction("sum", t.dtype, world))
    except pycoll.MismatchError as e:
        return str(e)
    finally:
        path.close(abort=True)
        path.slots.close()
    return None


def test_ipc_mismatch_is_an_error_on_every_rank():
    res = run_ranks(_ipc_mismatch, 2, timeout=60)
    assert all(r and "numel=4" in r and "numel=5" in r for r in res), res


# -- on a GPU ----------------------------------------------------------------------------------------------
def _gpu_battery(rank, world):
    """Every c10d collective on CUDA tensors through whatever path PYCOLL_CUDA_PATH forces."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    pg = dist.distributed_c10d._get_default_group()

    def inp(r, n, dtype):
        return _inp(r, n, dtype).to(dev)

    def check(got, want, what):
        torch.testing.assert_close(got.cpu(), want.cpu(), msg=what)

    done = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                  torch.int8, torch.uint8, torch.bool, torch.complex64):
        ins = [inp(r, 1000, dtype) for r in range(world)]
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if dtype.is_complex:
            ops = {"sum": dist.ReduceOp.SUM}
        for name, op in ops.items():
            t = ins[rank].clone()
            dist.all_reduce(t, op)
            st = torch.stack([x.cpu() for x in ins])
            if dtype is torch.bool:
                want = st.any(0) if name in ("sum", "max") else st.all(0)
            else:
                want = {"sum": st.sum(0, dtype=dtype) if not dtype.is_floating_point else st.double().sum(0),
                        "max": st.amax(0) if not dtype.is_complex else None,
                        "min": st.amin(0) if not dtype.is_complex else None}[name]
            check(t, want.to(dtype), f"all_reduce {name} {dtype}")
        done.append(str(dtype))
    x = [inp(r, 777, torch.float32) for r in range(world)]
    t = x[rank].clone()
    dist.all_reduce(t, dist.ReduceOp.AVG)
    check(t, sum(x) / world, "avg")
    t = x[rank].clone()
    dist.all_reduce(t, dist._make_nccl_premul_sum(0.5))
    check(t, sum(x) * 0.5, "premul_sum")
    t = inp(rank, 10, torch.int64)
    dist.all_reduce(t, dist.ReduceOp.PRODUCT)
    check(t, torch.stack([inp(r, 10, torch.int64).cpu() for r in range(world)]).prod(0), "product")
    # big: several IPC rounds and the two-phase path; bandwidth-sized for NCCL
    big = [inp(r, 3_000_001, torch.float32) for r in range(world)]
    t = big[rank].clone()
    dist.all_reduce(t)
    check(t, sum(big), "all_reduce 12 MB")
    # non-contiguous and empty
    t = x[rank][:700].clone().view(70, 10).t()
    dist.all_reduce(t)
    check(t, sum(v[:700].view(70, 10).t() for v in x), "non-contiguous")
    e = torch.empty(0, device=dev)
    dist.all_reduce(e)
    root = world - 1
    t = x[rank].clone()
    dist.broadcast(t, root)
    check(t, x[root], "broadcast")
    t = x[rank].clone()
    dist.reduce(t, root)
    check(t, sum(x) if rank == root else x[rank], "reduce")
    outs = [torch.empty_like(x[rank]) for _ in range(world)]
    dist.all_gather(outs, x[rank])
    check(torch.stack(outs), torch.stack(x), "all_gather")
    out = torch.empty(777 * world, device=dev)
    dist.all_gather_into_tensor(out, x[rank])
    check(out, torch.cat(x), "all_gather_into_tensor")
    out = torch.empty(259, device=dev)
    dist.reduce_scatter_tensor(out, torch.cat([inp(rank, 259, torch.float32) + q for q in range(world)]))
    check(out, sum(inp(r, 259, torch.float32) + rank for r in range(world)), "reduce_scatter_tensor")
    out = torch.empty(5 + rank, device=dev)
    dist.reduce_scatter(out, [torch.full((5 + q,), float(rank + q), device=dev) for q in range(world)])
    check(out, torch.full((5 + rank,), float(sum(r + rank for r in range(world)))), "reduce_scatter uneven")
    sc = [(rank + d) % 3 + 1 for d in range(world)]
    rc = [(s + rank) % 3 + 1 for s in range(world)]
    send = torch.cat([torch.full((c,), rank * 100.0 + d) for d, c in enumerate(sc)]).to(dev)
    recv = torch.empty(sum(rc), device=dev)
    dist.all_to_all_single(recv, send, rc, sc)
    check(recv, torch.cat([torch.full((c,), s * 100.0 + rank) for s, c in enumerate(rc)]), "all_to_all_single")
    outs = [torch.empty(c, device=dev) for c in rc]
    dist.all_to_all(outs, list(send.split(sc)))
    check(torch.cat(outs), recv, "all_to_all")
    g = [torch.empty(777, device=dev) for _ in range(world)] if rank == root else None
    dist.gather(x[rank], g, dst=root)
    if rank == root:
        check(torch.stack(g), torch.stack(x), "gather")
    out = torch.empty(777, device=dev)
    dist.scatter(out, list(x) if rank == 0 else None, src=0)
    check(out, x[rank], "scatter")
    if world > 1:
        t = x[rank].clone()
        if rank == 0:
            dist.send(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            check(t, x[0], "send/recv")
    # async + a side stream: wait() orders the stream; the future completes with the outputs
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        t = x[rank].clone()
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        total = t.sum()
    side.synchronize()
    fut = dist.all_reduce(t, async_op=True).get_future()
    got = fut.wait()
    torch.cuda.synchronize()
    check(got[0], sum(x) * world, "future")
    assert abs(total.item() - sum(v.sum().item() for v in x)) < 1e-2 * abs(total.item())
    dist.barrier()
    dist.barrier(device_ids=[dev.index])
    torch.cuda.synchronize()
    return pg._cuda.path, done


def _nccl_ok() -> bool:
    from pycoll.cuda.facts import nccl_importable
    return nccl_importable()


@needs_gpu
@pytest.mark.parametrize("path,world", [("staging", 2), ("ipc", 2), ("ipc", 3), ("nccl", 1), ("nccl", 2)])
def test_every_collective_on_gpu(path, world):
    if path == "nccl" and not _nccl_ok():
        pytest.skip("cupy.cuda.nccl is not importable")
    if path == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs one GPU per rank; {torch.cuda.device_count()} here")
    res = run_ranks(_gpu_battery, world, backend="pycoll", timeout=240,
                    env={"PYCOLL_CUDA_PATH": path, "PYCOLL_CUDA_IPC_SLOT_BYTES": str(4 << 20)})
    assert [r[0] for r in res] == [path] * world
    assert len(res[0][1]) == 10


def _auto_path(rank, world):
    t = torch.ones(4, device="cuda:0")
    dist.all_reduce(t)
    assert t.tolist() == [float(world)] * 4
    return dist.distributed_c10d._get_default_group()._cuda.path


@needs_gpu
def test_auto_takes_ipc_for_ranks_sharing_a_gpu():
    assert run_ranks(_auto_path, 2, backend="pycoll", timeout=120) == ["ipc", "ipc"]


def _forced_nccl_on_one_gpu(rank, world):
    try:
        dist.all_reduce(torch.ones(4, device="cuda:0"))
    except pycoll.cuda.CudaPathError as e:
        return str(e)
    return None


@needs_gpu
def test_forced_nccl_on_a_shared_gpu_says_why():
    res = run_ranks(_forced_nccl_on_one_gpu, 2, backend="pycoll", timeout=120, env={"PYCOLL_CUDA_PATH": "nccl"})
    assert all(r and ("same GPU" in r or "pycoll[cuda]" in r) for r in res), res


def _gpu_ipc_mismatch(rank, world):
    try:
        dist.all_reduce(torch.ones(4 + rank, device="cuda:0"))
        torch.cuda.synchronize()
    except pycoll.MismatchError as e:
        return str(e)
    return None


@needs_gpu
def test_gpu_ipc_mismatch():
    res = run_ranks(_gpu_ipc_mismatch, 2, backend="pycoll", timeout=120, env={"PYCOLL_CUDA_PATH": "ipc"})
    assert all(r and "numel=4" in r and "numel=5" in r for r in res), res


def test_no_cuda_import_side_effects():
    """``import pycoll`` (done above) must not have initialised CUDA in this process."""
    assert not torch.cuda.is_initialized()
