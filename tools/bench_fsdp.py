"""FSDP2 benchmark: fully_shard training steps/s on gloo, pycoll, and pycoll on registered buffers.

    python tools/bench_fsdp.py [--world-size 2] [--rounds 5] [--steps 4]

``world_size`` rank processes (spawned, one torch thread each, as under torchrun) share a
TCPStore on port 0; each opens a gloo default group and a pycoll ``new_group``, and builds
the MLP of ``tools/bench_ddp.py`` three times, each layer ``fully_shard``-ed on a mesh over
one group: ``gloo``, ``pycoll`` (FSDP2's own buffers, the staged shared-memory path) and
``pycoll registered`` (``set_allocate_memory_from_process_group_for_comm(True)`` on every
FSDP module: its all_gather outputs and reduce_scatter inputs come from the group's
``allocate_tensor``, so both collectives run in place, ``core.shm_registered``). The
configurations run interleaved, ``--steps`` timed steps each per round, timed by the
slowest rank; the table gives the median steps/s over rounds and, as a check, the last
loss of each (the three train the same model on the same data).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from pycoll.testing import spawn  # noqa: E402

CONFIGS = ("gloo", "pycoll", "pycoll registered")


def _model(group, registered: bool) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tools.bench_ddp import mlp

    torch.manual_seed(0)
    model = mlp()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if registered:
        for m in model.modules():
            if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
                m.set_allocate_memory_from_process_group_for_comm(True)
    return model


def _rank(rank: int, world: int, port: int, opts: dict) -> dict:
    torch.set_num_threads(1)
    import pycoll  # noqa: F401  (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store, timeout=timedelta(seconds=120))
    ours = dist.new_group(backend="pycoll")
    groups = {"gloo": dist.group.WORLD, "pycoll": ours, "pycoll registered": ours}
    models = {c: _model(groups[c], c.endswith("registered")) for c in CONFIGS}
    opts_ = {c: torch.optim.SGD(m.parameters(), lr=0.01) for c, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=g), torch.randint(0, 10, (32,), generator=g)

    def step(c):
        loss = nn.functional.cross_entropy(models[c](x), y)
        loss.backward()
        opts_[c].step()
        opts_[c].zero_grad()
        return loss.item()

    times = {c: [] for c in CONFIGS}
    last = {}
    for c in CONFIGS:    # warm-up
        step(c)
    for r in range(opts["rounds"]):
        for c in CONFIGS[r % 3:] + CONFIGS[:r % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(opts["steps"]):
                last[c] = step(c)
            times[c].append(time.perf_counter() - t0)
    del models, opts_
    dist.destroy_process_group()
    return {"times": times, "last": last}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args(argv)
    world = a.world_size
    try:
        results = spawn.run(_rank, world, vars(a))
    except spawn.RankFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"# FSDP2 (fully_shard per layer) on the 25.2M MLP, world {world}, {a.rounds} rounds x "
          f"{a.steps} steps, interleaved; median steps/s of the slowest rank")
    print(f"{'config':>18} {'steps/s':>8} {'vs gloo':>8} {'last loss':>10}")
    rate = {}
    for c in CONFIGS:
        per_round = [max(ts) for ts in zip(*(r["times"][c] for r in results))]
        rate[c] = a.steps / statistics.median(per_round)
    for c in CONFIGS:
        print(f"{c:>18} {rate[c]:>8.2f} {rate[c] / rate['gloo']:>7.2f}x {results[0]['last'][c]:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
