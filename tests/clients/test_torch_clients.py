"""torch's own clients on pycoll, as users run them, compared with gloo where gloo runs them.

torch's per-device backend lookups (DCP async save, the full-state-dict broadcast into
FSDP2, ``_set_pg_timeout``), ``torch.compile(DDP(model))``, sparse all-reduce (also under
DDP), torch's timeout wording and monitored barriers with their own timeouts. Callbacks and
peer death under DDP are in test_callbacks.py; torchrun's restarts and re-inits on one store
in test_elastic.py.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pycoll
from pycoll.testing.ranks import rank_store, run_ranks

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

TORCH_TIMEOUT_WORDS = re.compile(" (Timed out|closed|timeout) ")


# -- per-device lookups ---------------------------------------------------------------------
def _lookups(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    try:
        pg._get_backend(torch.device("meta"))
        meta = "found"
    except RuntimeError as exc:
        meta = str(exc)
    return {"cpu in device types": torch.device("cpu") in pg._device_types,
            "name": pg.name(), "splitting": bool(backend.supports_splitting),
            "meta": "No backend type associated with device type meta" in meta}


def test_per_device_lookups_answer_as_on_gloo():
    gloo = run_ranks(_lookups, 2, backend="gloo")
    ours = run_ranks(_lookups, 2, backend="pycoll")
    for g, o in zip(gloo, ours):
        assert o["cpu in device types"] is g["cpu in device types"] is True
        assert (g["name"], o["name"]) == ("gloo", "pycoll")
        assert o["splitting"] is True   # gloo's is False; torch's dist.split_group is accelerator-only
        assert o["meta"] and g["meta"]


def _device_backend_string(rank, world):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    pg = dist.distributed_c10d._get_default_group()
    return t.tolist(), pg._get_backend(torch.device("cpu")).name(), bool(pg._get_backend(torch.device("cpu")).supports_shrinking)


def test_cpu_colon_pycoll_is_the_same_backend():
    for backend in ("cpu:pycoll", "pycoll"):
        assert run_ranks(_device_backend_string, 2, backend=backend) == [([3.0] * 3, "pycoll", True)] * 2


def _pg_timeout(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=1), pg)
    store = rank_store()
    if rank == 1:      # absent until rank 0's barrier has ended: it must time out after 1 s
        store.wait(["barrier ended"])
        return None
    t0 = time.monotonic()
    try:
        dist.barrier()
        took, text = time.monotonic() - t0, "no error"
    except Exception as exc:  # noqa: BLE001 - the error is the result
        took, text = time.monotonic() - t0, str(exc)
    store.set("barrier ended", "1")
    return took, text


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_set_pg_timeout_takes_effect_and_speaks_torchs_words(transport):
    res = run_ranks(_pg_timeout, 2, backend="pycoll", timeout=60, env={"PYCOLL_TRANSPORT": transport})
    seconds, text = res[0]
    assert 0.9 < seconds < 20, seconds   # 1 s, not the group's 60 s (a loaded machine may add)
    assert TORCH_TIMEOUT_WORDS.search(text) and "Timed out waiting 1000ms" in text, text


def _barrier_own_timeout(rank, world):
    if rank == 1:
        time.sleep(1)
        return None
    try:
        dist.barrier(timeout=timedelta(milliseconds=1))
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "no error"


def test_a_collectives_own_timeout_is_named():
    res = run_ranks(_barrier_own_timeout, 2, backend="pycoll", timeout=60)
    assert "Timed out waiting 1ms" in res[0], res[0]


# -- distributed checkpoint and FSDP2 ----------------------------------------------------------
def _dcp(rank, world, folder):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0) + rank, "step": torch.tensor(rank + 10)}
    future = dcp.async_save(state, checkpoint_id=folder)
    future.result()
    dist.barrier()
    loaded = {"w": torch.zeros(6), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=folder)
    return loaded["w"].tolist(), int(loaded["step"])


def test_dcp_async_save_then_load(tmp_path):
    ours = run_ranks(_dcp, 2, str(tmp_path / "pycoll"), backend="pycoll", timeout=120)
    gloo = run_ranks(_dcp, 2, str(tmp_path / "gloo"), backend="gloo", timeout=120)
    assert ours == gloo
    assert ours[0][0] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]   # replicated keys: one rank's copy is kept


def _fsdp_full_state_dict(rank, world):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)          # ranks start different: only rank 0's values are right
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model)
    set_model_state_dict(model, full if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    back = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.manual_seed(0)
    expect = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).state_dict()
    return all(torch.equal(back[k], expect[k]) for k in expect)


def test_full_state_dict_broadcast_into_fsdp2():
    assert run_ranks(_fsdp_full_state_dict, 2, backend="pycoll", timeout=120) == [True, True]


# -- torch.compile(DDP(model)) ----------------------------------------------------------------
def _compiled_ddp(rank, world, compile_backend):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = torch.compile(DDP(module), backend=compile_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).sum().backward()
        opt.step()
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compiled_ddp_matches_gloo(compile_backend):
    ours = run_ranks(_compiled_ddp, 2, compile_backend, backend="pycoll", timeout=170)
    gloo = run_ranks(_compiled_ddp, 2, compile_backend, backend="gloo", timeout=170)
    for a, b in zip(ours, gloo):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# -- sparse all-reduce ------------------------------------------------------------------------
def _sparse(rank, world):
    i = torch.tensor([[0, 2, rank], [1, 0, 3]])
    t = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, 10.0 * (rank + 1)]), (4, 5))
    dist.all_reduce(t)
    hybrid = torch.sparse_coo_tensor(torch.tensor([[rank], [1]]), torch.tensor([[1.0, 2.0]]), (3, 4, 2))
    dist.all_reduce(hybrid)
    empty = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (3, 3))
    dist.all_reduce(empty)
    return t.to_dense(), hybrid.to_dense(), empty.to_dense()


def _sparse_ddp(rank, world, backend):
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.new_group(backend=backend)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(24, 2))
    model = DDP(module, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randint(0, 50, (4, 3), generator=g)).sum().backward()
        opt.step()
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sparse_all_reduce_matches_gloo(transport):
    env = {"PYCOLL_TRANSPORT": transport}
    gloo = run_ranks(_sparse, 2, backend="gloo")
    ours = run_ranks(_sparse, 2, backend="pycoll", env=env)
    for a, b in zip(gloo, ours):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    on_gloo = run_ranks(_sparse_ddp, 2, "gloo", backend="pycoll", env=env)
    on_ours = run_ranks(_sparse_ddp, 2, "pycoll", backend="pycoll", env=env)
    for a, b in zip(on_gloo, on_ours):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# -- monitored barrier with its own timeout ----------------------------------------------------
def _monitored_alone(rank, world):
    sub = dist.new_group([0, 1])
    store = rank_store()
    if rank == 1:       # never arrives while rank 0 waits
        store.wait(["done"])
        return None
    out = {}
    for timeout in (timedelta(seconds=0.1), timedelta(0)):
        t0 = time.monotonic()
        try:
            pycoll.monitored_barrier(sub, timeout)
            out[timeout.total_seconds()] = ("no error", time.monotonic() - t0)
        except RuntimeError as exc:
            out[timeout.total_seconds()] = (str(exc), time.monotonic() - t0)
    try:
        sub.monitored_barrier(timedelta(0))     # c10d's method name, as torch's tests call it
    except RuntimeError as exc:
        out["method"] = str(exc)
    store.set("done", "1")
    return out


def test_monitored_barrier_honours_the_timeout_it_is_given():
    out = run_ranks(_monitored_alone, 2, backend="pycoll", timeout=60)[0]
    text, seconds = out[0.1]
    assert "Rank 1 failed to pass monitoredBarrier in 100 ms" in text and seconds < 20, out
    text, seconds = out[0.0]   # (the group's timeout is 60 s: a bound far below it is the test)
    assert "Rank 0 timed out in monitoredBarrier" in text and seconds < 20, out
    assert "Rank 0 timed out in monitoredBarrier" in out["method"], out
