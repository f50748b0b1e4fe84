"""``DistributedDataParallel``: the module wrapper users see (torch's names and arguments).

Construction: verify that every rank built the same model, broadcast parameters and
buffers from rank 0, build the reducer. Each forward: notify a join context if one is
active, rebuild buckets once after the first iteration, broadcast buffers, run the module,
and tell the reducer whether the coming backward synchronises. The gradient work itself
is in ``reducer.py``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn import Module

from .join import DDPJoinHook, JoinContext, exchange_join_state
from .partial_sync import attach as attach_partial
from .buckets import MB
from .reducer import Reducer, overlap_pays_for
from .sync import BufferBroadcaster, broadcast_tensors, verify_same_model
from .timeline import Timeline


class DistributedDataParallel(Module, Joinable):
    """Data-parallel training of ``module``: gradients are averaged across the process group
    during backward, bucket by bucket, overlapping communication with computation.

    ``shared_buckets``: None (the default) allocates the gradient buckets in memory that the
    group's ranks share when the group is a pycoll group on one host (``pycoll.empty_shared``),
    so that each bucket's all_reduce runs in place; False keeps ordinary buckets.

    The arguments are torch's, in torch's order (``first_bucket_cap_mb`` and what follows it
    are ours, keyword-only). ``device_ids``/``output_device`` may only name the device the
    module already lives on (inputs are not moved); ``dim`` and ``check_reduction`` are
    accepted and unused, as in torch for modules on one device; ``init_sync=False`` skips
    the same-model check and the broadcast from rank 0.

    ``bucket_cap_mb`` / ``first_bucket_cap_mb``: None for both (the default) means torch's
    25 and 1 MB, except on a one-host pycoll group whose cores cannot give each rank's
    collective worker one of its own (``ddp.buckets.overlap_pays``): there the gradients go
    in one bucket per dtype, reduced once backward ends, since overlapping would only take
    cores from backward. A cap you pass (either) is used, the other being torch's."""

    def __init__(self, module: Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, first_bucket_cap_mb: float | None = None,
                 sync: str = "full", max_staleness: int = 4, activation_delay: float = 0.01,
                 shared_buckets: bool | None = None) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs torch.distributed.init_process_group first")
        _check_devices(module, device_ids, output_device)
        del dim, check_reduction   # torch's, for scattering inputs / long deprecated
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self._divide_by_initial_world_size = True

        named_params = list(module.named_parameters())  # tied parameters appear once
        named_buffers = list(module.named_buffers())
        if init_sync:   # (False: the caller vouches that every rank holds the same model)
            verify_same_model(named_params + named_buffers, self.process_group)
            broadcast_tensors(self.state_tensors(), 0, self.process_group)
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise RuntimeError("DistributedDataParallel is not needed for a module with no "
                               "parameter that requires a gradient")
        self.reducer = Reducer([p for _, p in trainable], [n for n, _ in trainable],
                               self.process_group, bucket_cap_mb, first_bucket_cap_mb,
                               find_unused_parameters, gradient_as_bucket_view, static_graph,
                               shared_buckets)
        buffers = [b for _, b in named_buffers]
        self._buffer_sync = BufferBroadcaster(buffers) if broadcast_buffers and self.world_size > 1 else None
        # sync="solo"|"majority": eager-SGD partial all-reduce (partial_sync.py); None for "full"
        self.partial = attach_partial(self, sync, max_staleness, activation_delay=activation_delay)

    def state_tensors(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.module.parameters()] + list(self.module.buffers())

    # ---- forward --------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        joining = self._join_config.enable
        notified = Join.notify_join_context(self) if joining else None
        self.reducer.rebuild_if_pending()
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        divisor, src = self.world_size, 0
        if joining:
            active, _ = exchange_join_state(self, active=True, sync=sync)
            if not self._divide_by_initial_world_size:
                divisor = len(active)
            src = active[0]  # rank 0 may have joined: the lowest rank still training
        if notified is not None:
            notified.wait()
        self.sync_buffers(src)
        outputs = self.module(*inputs, **kwargs)
        self.reducer.prepare_for_backward(outputs, sync, divisor)
        return outputs

    def sync_buffers(self, src: int) -> None:
        if self._buffer_sync:
            self._buffer_sync.broadcast(src, self.rank, self.process_group)

    # ---- torch's DDP API ------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally; the next synchronised backward
        (its forward outside this context) reduces the accumulated gradients."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """``hook(state, bucket) -> Future[Tensor]`` replaces each bucket's all-reduce;
        see ``ddp.hooks``. Call once, before the first backward."""
        self.reducer.register_comm_hook(state, hook)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> JoinContext:
        """Context for uneven inputs: ranks that run out of data shadow the others'
        collectives until every rank is done, then all ranks end with the same model."""
        return JoinContext(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.reducer.params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # ---- introspection --------------------------------------------------------------
    @property
    def timeline(self) -> Timeline:
        """Ready / all-reduce start / end times per bucket of the last synchronised backward."""
        return self.reducer.timeline

    def bucket_indices(self) -> list[list[int]]:
        """Each bucket's parameters as indices into the trainable ``parameters()``."""
        return self.reducer.bucket_indices()


def _check_devices(module: Module, device_ids, output_device) -> None:
    """torch's ``device_ids``/``output_device`` are for moving inputs to the module's device,
    which this DDP does not do: accept them only where they name that device already."""
    if device_ids is None and output_device is None:
        return
    devices = {p.device for p in module.parameters()}
    named = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
             for d in list(device_ids or []) + ([output_device] if output_device is not None else [])]
    if len(devices) != 1 or any(d != next(iter(devices)) for d in named):
        raise ValueError(
            f"DistributedDataParallel: device_ids={device_ids!r}, output_device={output_device!r} "
            f"must be None or name the one device the module's parameters are on "
            f"({sorted(map(str, devices))}); this DDP does not move inputs between devices")


def default_bucket_cap_mb(module: Module, process_group=None) -> float:
    """The ``bucket_cap_mb`` that this DDP's defaults amount to for ``module`` on
    ``process_group``, to give torch's DDP the same choice: 25 (torch's), or, on a one-host
    pycoll group with no core to spare (``ddp.buckets.overlap_pays``), a cap that puts all
    of the module's gradients in one bucket (torch's own first bucket stays 1 MB). A
    collective on one-host pycoll groups: call it on every rank."""
    group = process_group if process_group is not None else dist.group.WORLD
    params = [p for p in module.parameters() if p.requires_grad]
    if overlap_pays_for(group, params):
        return 25.0
    return float(sum(p.numel() * p.element_size() for p in params) // MB + 1)
