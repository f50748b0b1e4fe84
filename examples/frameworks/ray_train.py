"""Ray Train on pycoll, by name: ``TorchTrainer(..., torch_config=TorchConfig(backend="pycoll"))``.

    python examples/frameworks/ray_train.py out_dir pycoll gloo

Ray's worker processes never import pycoll; torch registers it in them at ``import torch``
through pycoll's ``torch.backends`` entry point. A local Ray instance, two workers; each
backend's rank 0 writes the backend torch used and the final weights to
``out_dir/<backend>_out.json``.
"""

import json
import os
import sys
import tempfile

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def loop(config) -> None:
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = dist.get_rank()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1 + rank))
    for i in range(0, 32, 8):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[i:i + 8]), x[i:i + 8].sum(1, keepdim=True)).backward()
        opt.step()
    if rank == 0:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        with open(config["out"], "w") as f:
            json.dump({"backend": dist.get_backend(), "weights": weights.tolist()}, f)


def main(out_dir: str, backends: list[str]) -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for backend in backends:
            TorchTrainer(loop, train_loop_config={"out": os.path.join(out_dir, f"{backend}_out.json")},
                         scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
                         torch_config=TorchConfig(backend=backend),
                         run_config=RunConfig(storage_path=tempfile.mkdtemp(dir=out_dir), name=backend)).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
