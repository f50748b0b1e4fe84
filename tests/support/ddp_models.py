"""Shared by the ddp tests (no tests here): small models, data, a local reference trainer."""

from __future__ import annotations

import torch
from torch import nn

IN, HID, OUT = 6, 16, 3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(),
                         nn.Linear(HID, OUT))


class Unused(nn.Module):
    """``never`` gets no gradient on any rank; ``sometimes`` only where ``flag`` is true."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, HID), nn.Linear(HID, OUT)
        self.never, self.sometimes = nn.Linear(HID, HID), nn.Linear(HID, HID)

    def forward(self, x, flag: bool = False):
        h = torch.tanh(self.fc1(x))
        if flag:
            h = torch.tanh(self.sometimes(h))
        return self.fc2(h)


def frozen() -> nn.Module:
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


class Tied(nn.Module):
    """``dec.weight`` is ``enc.weight``: one parameter, two uses, one gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.enc, self.dec = nn.Linear(IN, HID), nn.Linear(HID, HID), nn.Linear(HID, HID)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(HID, OUT)

    def forward(self, x):
        h = torch.tanh(self.enc(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.dec(h)))


def batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HID), nn.BatchNorm1d(HID), nn.Tanh(), nn.Linear(HID, OUT))


class Reordered(nn.Module):
    """Registers ``late`` before ``early``: parameters() order is not the backward order."""

    def __init__(self) -> None:
        super().__init__()
        self.late, self.early = nn.Linear(HID, OUT), nn.Linear(IN, HID)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


MODELS = {"mlp": mlp, "unused": Unused, "frozen": frozen, "tied": Tied,
          "batchnorm": batchnorm, "reordered": Reordered}


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def batches(step: int, micro: int, world: int, per_rank: int = 4):
    """The global batch of (step, micro-batch), as ``world`` per-rank chunks."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(world * per_rank, IN, generator=g)
    y = torch.randn(world * per_rank, OUT, generator=g)
    return list(zip(x.chunk(world), y.chunk(world)))


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def flag_for(rank: int, step: int) -> bool:
    return (rank + step) % 2 == 0


def local_train(name: str, world: int, steps: int, micro: int, counts: list[int] | None,
                flags: bool, concat: bool) -> nn.Module:
    """Single-process training that DDP must reproduce.

    Each step's gradient is (1/world) * sum over ranks of rank r's mean loss gradient: with
    ``concat`` and equal chunks that is one forward over the concatenated batch. Otherwise
    (BatchNorm statistics, per-rank flags, uneven counts) each rank's chunk is run in turn;
    buffers end as rank 0's (DDP broadcasts rank 0's buffers).
    """
    model = build(name, seed=0)
    opt = optimizer(model)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            chunks = batches(step, m, world)
            active = [r for r in range(world) if counts is None or counts[r] > step]
            if concat and len(active) == world and not flags:
                x = torch.cat([c[0] for c in chunks])
                y = torch.cat([c[1] for c in chunks])
                loss_fn(model(x), y).backward()
                continue
            start = {k: v.clone() for k, v in model.named_buffers()}
            after0 = None
            for r in active:
                with torch.no_grad():
                    for k, v in model.named_buffers():
                        v.copy_(start[k])
                kwargs = {"flag": flag_for(r, step)} if flags else {}
                (loss_fn(model(chunks[r][0], **kwargs), chunks[r][1]) / world).backward()
                if r == active[0]:
                    after0 = {k: v.clone() for k, v in model.named_buffers()}
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(after0[k])
        opt.step()
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 1.0
    return (a - b).abs().max().item() / max(scale, 1e-12) if a.numel() else 0.0


def max_rel_err(m1: nn.Module, m2: nn.Module, buffers: bool = False) -> float:
    s1, s2 = dict(m1.named_parameters()), dict(m2.named_parameters())
    if buffers:
        s1.update((k, v) for k, v in m1.named_buffers() if v.is_floating_point())
        s2.update((k, v) for k, v in m2.named_buffers() if v.is_floating_point())
    assert s1.keys() == s2.keys(), (sorted(s1), sorted(s2))
    return max(rel_err(s1[k].detach(), s2[k].detach()) for k in s1)
