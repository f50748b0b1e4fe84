"""HF Accelerate on pycoll: make the group first, then ``Accelerator()``.

    torchrun --nproc-per-node 2 examples/frameworks/accelerate_cpu.py pycoll out.json   # or gloo

Accelerate picks the CPU backend itself (``accelerate/state.py``, ``_prepare_backend``: mpi
if torch has it, else gloo) and refuses any other name: ``InitProcessGroupKwargs(backend=
"pycoll")`` raises "Your assigned backend pycoll is not available, please use gloo". It does
not make a group when one exists, so one line before ``Accelerator()`` is the recipe:
``dist.init_process_group("pycoll")``. (``by-name`` shows the refusal.)
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, InitProcessGroupKwargs
from torch import nn


def main(mode: str, out: str) -> None:
    if mode == "by-name":
        try:
            Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="pycoll")])
            print("RESULT no error")
        except ValueError as exc:
            print(f"RESULT {exc}")
        return
    if mode == "pycoll":
        dist.init_process_group("pycoll")          # the recipe: the group first
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    model, opt, data = acc.prepare(model, opt, data)
    for _ in range(2):
        for xb, yb in data:
            opt.zero_grad()
            acc.backward(nn.functional.mse_loss(model(xb), yb))
            opt.step()
    if acc.is_main_process:
        weights = torch.cat([p.detach().flatten() for p in acc.unwrap_model(model).parameters()])
        with open(out, "w") as f:
            json.dump({"backend": dist.get_backend(), "weights": weights.tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
