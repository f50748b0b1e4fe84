"""Routes c10d calls with CUDA tensors to the CUDA channel; CPU calls pass straight through.

``install(ProcessGroupPycoll)`` wraps the methods that take tensors: a call whose first two
arguments hold a CUDA tensor goes to the group's ``CudaChannel`` (made on first use); any other
call runs the CPU method unchanged, at the cost of one scan of the argument lists. The
coalesced variants call the wrapped single-tensor methods, so they need no wrapper of their own.

``barrier()``: with ``device_ids`` (``dist.barrier(device_ids=[i])``) it is a CUDA barrier of
the chosen path (on nccl a 1-element all-reduce the host waits for, as torch's NCCL backend
does); without, it is the CPU barrier, preceded, once this group has used CUDA, by a wait for
this rank's current stream, so that "everyone passed the barrier" also means "everyone's
CUDA work issued before it has finished".
"""

from __future__ import annotations

import functools

import torch

METHODS = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single",
           "broadcast", "allgather", "all_gather_single", "allgather_coalesced", "gather", "scatter",
           "alltoall", "all_to_all_single", "send", "recv", "recv_anysource")
ALIASES = {"_reduce_scatter_base": "reduce_scatter_single", "_allgather_base": "all_gather_single",
           "alltoall_base": "all_to_all_single"}
ATTR = "_pycoll_cuda"


def has_cuda(args) -> bool:
    """Whether the first two arguments (tensors, lists, lists of lists) hold a CUDA tensor."""
    for a in args[:2]:
        if isinstance(a, torch.Tensor):
            if a.is_cuda:
                return True
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    if x.is_cuda:
                        return True
                elif isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) and y.is_cuda for y in x):
                    return True
    return False


def channel(pg):
    ch = pg.__dict__.get(ATTR)
    if ch is None:
        from pycoll.cuda.frontend import CudaChannel

        ch = pg.__dict__[ATTR] = CudaChannel(pg)
    return ch


def _wrap(name: str, method):
    @functools.wraps(method)
    def dispatch(self, *args, **kwargs):
        if has_cuda(args):
            return channel(self).call(name, method, args, kwargs)
        return method(self, *args, **kwargs)
    dispatch.__pycoll_cpu__ = method
    return dispatch


def _wrap_barrier(method):
    @functools.wraps(method)
    def barrier(self, opts=None):
        ids = list(getattr(opts, "device_ids", None) or [])
        if ids:
            dev = torch.device("cuda", ids[0])
            return channel(self).call("barrier", method, (opts,), {}, device=dev)
        ch = self.__dict__.get(ATTR)
        if ch is not None:
            ch.sync_device()
        return method(self, opts)
    return barrier


def _wrap_close(method, abort: bool):
    @functools.wraps(method)
    def close(self, *args, **kwargs):
        ch = self.__dict__.get(ATTR)
        if ch is not None:
            ch.close(abort)
        return method(self, *args, **kwargs)
    return close


def install(cls) -> None:
    """Wrap ``cls``'s tensor methods (idempotent)."""
    if getattr(cls, "_pycoll_cuda_installed", False) or torch.version.cuda is None:
        return  # a CPU build of torch has no CUDA tensors: no wrapper on the latency path
    for name in METHODS:
        setattr(cls, name, _wrap(name, getattr(cls, name)))
    for alias, target in ALIASES.items():
        setattr(cls, alias, getattr(cls, target))
    cls.barrier = _wrap_barrier(cls.barrier)
    cls.shutdown = _wrap_close(cls.shutdown, False)
    cls.abort = _wrap_close(cls.abort, True)
    cls._pycoll_cuda_installed = True
