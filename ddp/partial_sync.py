"""Partial gradient synchronisation for ``DistributedDataParallel(sync="solo"|"majority")``.

eager-SGD (docs/papers.md section 2) on top of ``pycoll.partial.PartialAllReduce``: each
synchronised backward deposits this rank's gradients and applies the result of the round
paired with it, ``sum of contributions / number of contributions``. A rank that was slow
gets its gradient into a later round (at most ``max_staleness`` rounds later) instead of
holding everyone up; every rank applies every round's result once, in order, so replicas
stay identical at equal step counts.

It is wired in as a communication hook (the reducer is unchanged): buckets hand over their
gradients in launch order; the last bucket's call packs them, in parameter order (bucket
layouts change when buckets are rebuilt, a deposit's layout must not), into one tensor,
submits it and fills every bucket's future with its share of the round's average.

Per-step collectives on the user's group would resynchronise every step, so partial modes
refuse what needs them: ``find_unused_parameters``/``static_graph`` (a used-parameter
all-reduce per step) and broadcasting buffers every forward (pass ``broadcast_buffers=False``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from pycoll.partial import PartialAllReduce, RoundResult

if TYPE_CHECKING:
    from .distributed import DistributedDataParallel

SYNC_MODES = ("full", "solo", "majority")


class PartialSync:
    """One partial all-reduce of all trainable gradients; ``hook`` is the comm hook."""

    def __init__(self, params: Sequence[torch.Tensor], group, mode: str, max_staleness: int,
                 seed: int = 0) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or any(p.device.type != "cpu" for p in params):
            raise ValueError(f"DistributedDataParallel(sync={mode!r}) needs CPU parameters of one "
                             f"dtype, got {sorted(map(str, dtypes))}")
        self.offsets: dict[int, tuple[int, int]] = {}
        total = 0
        for p in params:
            self.offsets[id(p)] = (total, p.numel())
            total += p.numel()
        self.flat = torch.zeros(total, dtype=params[0].dtype)
        self.allreduce = PartialAllReduce(self.flat, group=group, mode=mode,
                                          max_staleness=max_staleness, seed=seed)
        self._pending: list[tuple[object, torch.futures.Future]] = []
        self.last: RoundResult | None = None   # the round applied by the last backward

    def hook(self, _state, bucket) -> torch.futures.Future:
        with torch.no_grad():
            for p, grad in zip(bucket.parameters(), bucket.gradients()):
                off, n = self.offsets[id(p)]
                self.flat[off:off + n].copy_(grad.reshape(-1))
        fut: torch.futures.Future = torch.futures.Future()
        self._pending.append((bucket, fut))
        if bucket.is_last():
            self._complete()
        return fut

    def _complete(self) -> None:
        pending, self._pending = self._pending, []
        try:
            result = self.allreduce.submit(self.flat).result()
        except BaseException as exc:
            for _, fut in pending:
                fut.set_exception(exc)
            raise
        self.last = result
        avg = result.mean().reshape(-1)
        with torch.no_grad():
            for bucket, fut in pending:
                for p, grad in zip(bucket.parameters(), bucket.gradients()):
                    off, n = self.offsets[id(p)]
                    grad.copy_(avg[off:off + n].view_as(grad))
                fut.set_result(bucket.buffer())

    def flush(self) -> list[RoundResult]:
        """Collective: the rounds still owed to this rank (late gradients); not applied."""
        return self.allreduce.flush()

    def close(self) -> None:
        self.allreduce.close()


def attach(model: "DistributedDataParallel", sync: str, max_staleness: int, seed: int = 0) -> PartialSync | None:
    """Validate ``sync`` and, for a partial mode, register the partial hook on ``model``."""
    if sync not in SYNC_MODES:
        raise ValueError(f"DistributedDataParallel: sync must be one of {SYNC_MODES}, got {sync!r}")
    if sync == "full":
        return None
    if model.find_unused_parameters or model.static_graph:
        raise ValueError(f"DistributedDataParallel(sync={sync!r}) does not support "
                         "find_unused_parameters or static_graph (each needs a synchronising "
                         "all-reduce every step)")
    if model.broadcast_buffers and model.world_size > 1 and any(True for _ in model.module.buffers()):
        raise ValueError(f"DistributedDataParallel(sync={sync!r}): broadcasting buffers every "
                         "forward would synchronise every step; pass broadcast_buffers=False")
    partial = PartialSync(model.reducer.params, model.process_group, sync, max_staleness, seed)
    model.reducer.register_comm_hook(None, partial.hook)
    return partial
