"""The input pipeline of ``tools/bench_ddp.py --loader-workers N``: a vision job's CPU side.

A training job's ranks rarely have the machine to themselves: DataLoader worker processes
decode and augment samples beside them, on the same cores. ``TransformedImages`` makes each
sample on the CPU the way such a pipeline does (a "decoded" 40x40 image, then random crop,
flip, colour jitter and normalisation, ``work`` times over to set the cost per sample), and
``batches`` serves them from ``workers`` DataLoader processes for as long as the run lasts.

The samples depend only on (rank, index), so every configuration of a run sees the same kind
of data and a rerun sees the same data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

SIDE, CROP = 40, 32


class TransformedImages(Dataset):
    """An endless stream of augmented 3x32x32 images with labels, made per sample on CPU."""

    def __init__(self, rank: int, work: int) -> None:
        if work < 1:
            raise ValueError(f"work per sample must be >= 1, got {work}")
        self.rank, self.work = rank, work

    def __len__(self) -> int:
        return 2**31 - 1   # the run ends first: one iterator serves every configuration

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.rank * 2**32 + i)
        image = torch.rand(3, SIDE, SIDE, generator=g)
        for _ in range(self.work):
            ox, oy = torch.randint(0, SIDE - CROP + 1, (2,), generator=g).tolist()
            x = image[:, oy:oy + CROP, ox:ox + CROP]
            if torch.rand((), generator=g) < 0.5:
                x = x.flip(2)
            x = (x * torch.empty(3, 1, 1).uniform_(0.8, 1.2, generator=g)).clamp_(0, 1)
            x = (x - 0.5) / 0.25
        return x, i % 10


def batches(rank: int, workers: int, batch: int, work: int) -> Iterator:
    """Batches (images, labels) from ``workers`` DataLoader worker processes (0: this process)."""
    loader = DataLoader(TransformedImages(rank, work), batch_size=batch, num_workers=workers,
                        prefetch_factor=2 if workers else None)
    return iter(loader)
