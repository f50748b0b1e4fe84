"""All-reduce (SUM) of sparse COO tensors, with gloo's semantics.

Each rank's tensor is coalesced; the ranks all-gather their nonzero counts, then their
indices and values (padded to the largest count: two dense all-gathers), and every rank
adds the ``world`` sparse tensors and coalesces the sum, which replaces the input's
contents (as gloo's ``copy_``). ``nn.Embedding(sparse=True)`` under DDP reduces its
gradients this way.
"""

from __future__ import annotations

import torch

from pycoll.core import collectives
from pycoll.errors import MismatchError


def check(t: torch.Tensor, red, what: str) -> None:
    """What a rank can check alone, before any communication (``red``: the Reduction)."""
    if t.device.type != "cpu":
        raise ValueError(f"{what}: sparse tensors on {t.device} are not supported (CPU only)")
    if red.name != "sum" or red.factor is not None:
        raise ValueError(f"{what}: sparse tensors support ReduceOp.SUM only, got {red.name}")
    if t._base is not None:
        raise ValueError(f"{what}: a view of a sparse tensor cannot be reduced in place")


def all_reduce(comm, t: torch.Tensor, seq: int, deadline: float) -> None:
    world = comm.world
    with torch.no_grad():
        mine = t.coalesce()
        shape = list(mine.shape)
        meta = torch.tensor([mine._nnz(), mine.sparse_dim(), *shape], dtype=torch.int64)
        metas = torch.empty(world * meta.numel(), dtype=torch.int64)
        # Ranks of different shapes have metadata of different lengths: the signature of
        # this first all-gather (its element count) tells them apart.
        collectives.all_gather(comm, metas, meta, seq, deadline)
        metas = metas.view(world, -1)
        if not bool((metas[:, 1:] == metas[0, 1:]).all()):
            raise MismatchError(f"all_reduce seq {seq}: sparse tensors differ in shape or sparse "
                                f"dimensions across ranks: {metas[:, 1:].tolist()}", op="all_reduce", seq=seq)
        nnz = metas[:, 0].tolist()
        top = max(nnz)
        sparse_dim, dense = mine.sparse_dim(), shape[mine.sparse_dim():]
        idx = torch.zeros(sparse_dim, top, dtype=torch.int64)
        idx[:, :nnz[comm.rank]] = mine._indices()
        val = torch.zeros(top, *dense, dtype=mine.dtype)
        val[:nnz[comm.rank]] = mine._values()
        idxs = torch.empty(world * idx.numel(), dtype=torch.int64)
        vals = torch.empty(world * val.numel(), dtype=val.dtype)
        collectives.all_gather(comm, idxs, idx.reshape(-1), seq, deadline)
        collectives.all_gather(comm, vals, val.reshape(-1), seq, deadline)
        idxs = idxs.view(world, sparse_dim, top)
        vals = vals.view(world, top, *dense)
        total = torch.sparse_coo_tensor(
            torch.cat([idxs[r, :, :nnz[r]] for r in range(world)], dim=1),
            torch.cat([vals[r, :nnz[r]] for r in range(world)]), shape, dtype=mine.dtype).coalesce()
        t.copy_(total)
