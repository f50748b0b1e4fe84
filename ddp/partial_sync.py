"""Partial gradient synchronisation for ``DistributedDataParallel(sync="solo"|"majority")``.

eager-SGD (Li et al., "Taming Unbalanced Training Workloads in Deep Learning with
Partial Collective Operations", PPoPP 2020) on top of ``pycoll.partial.PartialAllReduce``: each
synchronised backward deposits this rank's gradients and applies the result of the round
paired with it, ``sum of contributions / number of contributions``. A rank that was slow
gets its gradient into a later round (at most ``max_staleness`` rounds later) instead of
holding everyone up; every rank applies every round's result once, in order, so replicas
stay identical at equal step counts.

It is wired in as a communication hook (the reducer is unchanged): buckets hand over their
gradients in launch order, each copied into one tensor laid out in reverse parameter order
(bucket layouts change when buckets are rebuilt, a deposit's layout must not; reverse order
is how DDP fills buckets, so a bucket is usually one range of it: one copy in, one divide
out); the last bucket's call submits it and fills every bucket's future with its share of
the round's average.

Per-step collectives on the user's group would resynchronise every step, so partial modes
refuse what needs them: ``find_unused_parameters``/``static_graph`` (a used-parameter
all-reduce per step) and broadcasting buffers every forward (pass ``broadcast_buffers=False``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.nn import Module

from pycoll import torch_compat
from pycoll.partial import PartialAllReduce, RoundInfo, RoundResult

SYNC_MODES = ("full", "solo", "majority")


class PartialSync:
    """One partial all-reduce of all trainable gradients; ``hook`` is the comm hook."""

    def __init__(self, params: Sequence[torch.Tensor], group, mode: str, max_staleness: int,
                 seed: int = 0, activation_delay: float = 0.01) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or any(p.device.type != "cpu" for p in params):
            raise ValueError(f"DistributedDataParallel(sync={mode!r}) needs CPU parameters of one "
                             f"dtype, got {sorted(map(str, dtypes))}")
        # The deposit's layout: reverse parameter order, the order DDP fills buckets in, so that
        # a bucket is usually one contiguous range of it (one copy in, one divide out).
        order = list(reversed(params))
        self.index = {id(p): i for i, p in enumerate(order)}
        self.sizes = [p.numel() for p in order]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.allreduce = PartialAllReduce(torch.zeros(self.offsets[-1], dtype=params[0].dtype),
                                          group=group, mode=mode, max_staleness=max_staleness, seed=seed,
                                          activation_delay=activation_delay)
        self._ranges: dict[tuple[int, ...], tuple[int, int] | None] = {}
        self._views: list[torch.Tensor] | None = None   # this step's deposit, split per parameter
        self._flat: torch.Tensor | None = None
        self._pending: list[tuple[object, torch.futures.Future]] = []
        self.last: RoundInfo | None = None     # the round applied by the last backward

    def _range(self, bucket) -> tuple[int, int] | None:
        """The deposit range a bucket's buffer maps onto one to one, or None (buckets are
        rebuilt after the first iteration, in gradient-ready order; any order is handled)."""
        params = bucket.parameters()
        key = tuple(map(id, params))
        if key not in self._ranges:
            idx = [self.index[i] for i in key]
            lo, hi = self.offsets[idx[0]], self.offsets[idx[-1] + 1]
            one_to_one = idx == list(range(idx[0], idx[0] + len(idx))) and bucket.buffer().numel() == hi - lo
            self._ranges[key] = (lo, hi) if one_to_one else None
        return self._ranges[key]

    def _slices(self, bucket) -> list[torch.Tensor]:
        if self._views is None:
            self._views = list(self._flat.split(self.sizes))
        return [self._views[self.index[id(p)]] for p in bucket.parameters()]

    def hook(self, _state, bucket) -> torch.futures.Future:
        if self._flat is None:
            self._flat = self.allreduce.buffer()   # filled in place: deposited without a copy
        r = self._range(bucket)
        with torch.no_grad():
            if r is not None:
                self._flat[r[0]:r[1]].copy_(bucket.buffer())
            else:   # one fused copy per bucket
                torch_compat.foreach_copy(self._slices(bucket), [g.reshape(-1) for g in bucket.gradients()])
        fut: torch.futures.Future = torch.futures.Future()
        self._pending.append((bucket, fut))
        if bucket.is_last():
            self._complete()
        return fut

    def _complete(self) -> None:
        pending, self._pending = self._pending, []
        flat, self._flat = self._flat, None
        try:
            result = self.allreduce.all_reduce(flat)
        except BaseException as exc:
            for _, fut in pending:
                fut.set_exception(exc)
            raise
        self.last = result.info
        self._views = None
        total, count = result.tensor.reshape(-1), result.count
        with torch.no_grad():
            for bucket, fut in pending:
                buf, r = bucket.buffer(), self._range(bucket)
                if not count:      # only after a flush: a round nobody contributed to
                    buf.zero_()
                elif r is not None:   # the average, sum / contributions, in one pass
                    torch.div(total[r[0]:r[1]], count, out=buf)
                else:
                    totals = [total[self.offsets[i]:self.offsets[i + 1]]
                              for i in (self.index[id(p)] for p in bucket.parameters())]
                    torch_compat.foreach_copy([g.reshape(-1) for g in bucket.gradients()], totals)
                    buf.div_(count)
                fut.set_result(buf)
        self.allreduce.recycle(result)

    def flush(self) -> list[RoundResult]:
        """Collective: the rounds still owed to this rank (late gradients); not applied."""
        return self.allreduce.flush()

    def close(self) -> None:
        self.allreduce.close()


def attach(model: Module, sync: str, max_staleness: int, seed: int = 0,
           activation_delay: float = 0.01) -> PartialSync | None:
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
    partial = PartialSync(model.reducer.params, model.process_group, sync, max_staleness, seed,
                          activation_delay)
    model.reducer.register_comm_hook(None, partial.hook)
    return partial
