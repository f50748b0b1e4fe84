"""Uneven inputs: the join hook a finished rank runs while the others still train.

Built on torch's public generic ``torch.distributed.algorithms.join.Join``: each forward of
a rank that still has data first notifies the join context (one all-reduce); a rank that
has run out of data answers that all-reduce from ``Join.__exit__`` and then calls
``main_hook``, which must issue exactly the collectives a training iteration issues, in
the same order (see ``DistributedDataParallel.forward``): rebuild exchange (once), join
state, buffer broadcast, and, if the others synchronise gradients, one zero-filled
all-reduce per bucket. ``post_hook`` copies the final model from a last-joining rank to
everyone, since joined ranks stopped stepping their optimisers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook
from torch.nn import Module

from .sync import broadcast_tensors


def exchange_join_state(ddp: Module, active: bool, sync: bool) -> tuple[list[int], int]:
    """One all-reduce: which ranks still train, and how many of them synchronise."""
    state = torch.zeros(ddp.world_size + 1, dtype=torch.int64)
    if active:
        state[ddp.rank] = 1
        state[-1] = int(sync)
    dist.all_reduce(state, group=ddp.process_group)
    values = state.tolist()
    return [r for r in range(ddp.world_size) if values[r]], values[-1]


class DDPJoinHook(JoinHook):
    def __init__(self, ddp: Module) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_if_pending()
        active, syncing = exchange_join_state(ddp, active=False, sync=False)
        ddp.sync_buffers(src=active[0] if active else 0)
        if syncing:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        last = torch.zeros(ddp.world_size, dtype=torch.int64)
        last[ddp.rank] = int(is_last_joiner)
        dist.all_reduce(last, group=ddp.process_group)
        src = int(last.nonzero()[0].item())
        broadcast_tensors(ddp.state_tensors(), src, ddp.process_group)


class JoinContext:
    """``with ddp.join():`` — torch's Join for this model, switched off again on exit."""

    def __init__(self, ddp: Module, divide_by_initial_world_size: bool,
                 enable: bool, throw_on_early_termination: bool) -> None:
        self._ddp = ddp
        self._join = Join([ddp], enable=enable, throw_on_early_termination=throw_on_early_termination,
                          divide_by_initial_world_size=divide_by_initial_world_size)

    def __enter__(self) -> "JoinContext":
        self._join.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._join.__exit__(*exc)
        finally:
            # Join leaves its config switched on; later forwards must not notify it.
            self._ddp._join_config = self._ddp._join_config._replace(enable=False)
