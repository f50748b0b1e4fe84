"""Lightning's DDP on pycoll, by name: ``DDPStrategy(process_group_backend="pycoll")``.

    python examples/frameworks/lightning_ddp.py pycoll out.json     # or gloo, to compare

Two CPU processes (Lightning starts the second one itself) fit a linear model on generated
data; rank 0 writes the backend torch used and the final weights to ``out.json``.
"""

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn


class Linear(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(backend: str, out: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    model = Linear()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        with open(out, "w") as f:
            json.dump({"backend": dist.get_backend(), "weights": weights.tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
