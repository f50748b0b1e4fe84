"""torch's own DistributedDataParallel trains on pycoll exactly as on gloo.

Each rank builds the same-seeded model twice (after a rank-dependent perturbation, so that
DDP's construction-time broadcast matters), wraps one copy in DDP over the pycoll default
group and the other in DDP over a gloo group of the same ranks, and trains both for a few
steps on the same rank-seeded batches. At world size 2 an all-reduce sum is a single IEEE
addition (commutative), so parameters must be bitwise identical; at world size 3 the two
backends may add in different orders, so a few ulps are allowed.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from pycoll.testing.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

STEPS = 5


def _model(rank: int) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                      nn.Linear(64, 4))
    with torch.no_grad():  # ranks start different: DDP must broadcast rank 0's parameters
        for p in m.parameters():
            p.add_(rank * 0.01)
    return m


def _train(rank: int, world: int, group, cfg: dict) -> tuple[list[torch.Tensor], list[float]]:
    model = DDP(_model(rank), process_group=group, **cfg.get("kw", {}))
    if cfg.get("hook"):
        model.register_comm_hook(group, getattr(default_hooks, cfg["hook"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad(set_to_none=False)
        if cfg.get("no_sync") and step % 2 == 0:
            with model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = [t.detach().clone() for t in model.module.state_dict().values()]
    params = [p.detach().clone() for p in model.module.parameters()]
    return state, losses, params


CONFIGS = {
    "defaults": {},
    "small_buckets_grad_view": {"kw": dict(bucket_cap_mb=0.005, gradient_as_bucket_view=True)},
    "no_sync": {"no_sync": True, "kw": dict(bucket_cap_mb=0.01)},
    "fp16_hook": {"hook": "fp16_compress_hook"},
}


def _ddp_vs_gloo(rank: int, world: int, names: list[str]) -> list[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ranks share 2 cores: no intra-op thread pools fighting over them
    try:
        return _ddp_vs_gloo_body(rank, world, names)
    finally:
        torch.set_num_threads(threads)


def _ddp_vs_gloo_body(rank: int, world: int, names: list[str]) -> list[str]:
    gloo = dist.new_group(backend="gloo")
    fails, times = [], {}
    for name in names:
        cfg = CONFIGS[name]
        t0 = time.perf_counter()
        p_state, p_loss, p_params = _train(rank, world, None, cfg)
        t1 = time.perf_counter()
        g_state, g_loss, _ = _train(rank, world, gloo, cfg)
        times[name] = (t1 - t0, time.perf_counter() - t1)
        for i, (a, b) in enumerate(zip(p_state, g_state)):
            if world == 2 or not a.is_floating_point():
                ok = torch.equal(a, b)
            else:
                ok = torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            if not ok:
                diff = (a.double() - b.double()).abs().max().item()
                fails.append(f"[{name} world={world} rank={rank}] state tensor {i} {tuple(a.shape)}: "
                             f"max abs diff {diff:.3g} (losses pycoll {p_loss} gloo {g_loss})")
        # parameters agree across ranks (DDP kept them in sync; BatchNorm statistics are local)
        flat = torch.cat([t.double().reshape(-1) for t in p_params])
        ref = flat.clone()
        dist.broadcast(ref, src=0, group=gloo)
        if not torch.equal(flat, ref):
            fails.append(f"[{name} world={world} rank={rank}] replicas differ from rank 0's")
    dist.destroy_process_group(gloo)
    return fails + [f"(timing) rank {rank} DDP seconds (pycoll, gloo): {times}"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,names", [(2, list(CONFIGS)), (3, ["defaults", "small_buckets_grad_view"])])
def test_torch_ddp_same_as_gloo(world, names):
    out = [f for r in run_ranks(_ddp_vs_gloo, world, names, backend="pycoll", timeout=110) for f in r]
    print("\n".join(f for f in out if f.startswith("(timing)")))
    fails = [f for f in out if not f.startswith("(timing)")]
    assert not fails, "\n".join(fails)


def _zero_vs_gloo(rank: int, world: int) -> list[str]:
    """torch's ZeroRedundancyOptimizer (broadcasts from every rank) on pycoll == on gloo;
    plus groups made with use_local_synchronization and new_subgroups_by_enumeration."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gloo = dist.new_group(backend="gloo")
    out = {}
    for label, group, backend in (("pycoll", None, None), ("gloo", gloo, "gloo")):
        model = DDP(_model(rank), process_group=group)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9,
                                      process_group=group)
        g = torch.Generator().manual_seed(2000 + rank)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
            opt.step()
        opt.consolidate_state_dict(to=world - 1)
        res = [p.detach().clone() for p in model.module.parameters()]
        if rank < 2:
            local = dist.new_group([0, 1], use_local_synchronization=True, backend=backend)
            t = torch.full((2,), float(rank + 1))
            dist.all_reduce(t, group=local)
            res.append(t)
        sub, _ = dist.new_subgroups_by_enumeration([[0], [1]], backend=backend)
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        res.append(t)
        out[label] = res
    torch.set_num_threads(threads)
    dist.destroy_process_group(gloo)
    return [f"rank {rank} tensor {i}: max abs diff {(a - b).abs().max().item():.3g}"
            for i, (a, b) in enumerate(zip(out["pycoll"], out["gloo"])) if not torch.equal(a, b)]


@pytest.mark.timeout(60)
def test_zero_optimizer_and_group_helpers_same_as_gloo():
    # world 2: a sum of two gradients is one commutative addition, so bitwise equality holds
    fails = [f for r in run_ranks(_zero_vs_gloo, 2, backend="pycoll", timeout=50) for f in r]
    assert not fails, "\n".join(fails)
