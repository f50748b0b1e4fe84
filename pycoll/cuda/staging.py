"""Host staging: CUDA tensors through pinned host memory and this group's CPU algorithms.

For one c10d call on CUDA tensors: every CUDA tensor of the call is copied to a pinned host
tensor on the caller's current stream, the host waits for those copies, the *same* call runs on
the host copies (so validation, ordering, shared memory, TCP, timeouts and error reporting are
exactly the CPU path's), and when that CPU Work completes the tensors the call writes are copied
back to the device, on the caller's stream, before the returned ``StagingWork`` reports
completion.

This path needs no cupy and works wherever torch works; it is the fallback and, for
point-to-point calls, the way the ipc path sends and receives. It costs two copies over PCIe
per tensor and a host synchronisation at each end.
"""

from __future__ import annotations

import torch

from pycoll.cuda.work import StagingWork


def _mirror(x, pairs: dict):
    """``x`` with every CUDA tensor replaced by a pinned host copy (recorded in ``pairs``)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cuda":
            return x
        host = pairs.get(id(x))
        if host is None:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            pairs[id(x)] = (x, host)
            return host
        return host[1]
    if isinstance(x, (list, tuple)):
        return type(x)(_mirror(v, pairs) for v in x)
    return x


def run(plan, host_call, args: tuple, device: torch.device, stream) -> StagingWork:
    """Make the call ``plan`` stands for on host copies of ``args``; see the module docstring.

    Every CUDA tensor of the call is copied to the host (outputs too: an in-place collective
    reads what it writes, and a copy is cheaper than telling them apart per method); the
    plan's outputs are copied back once the CPU Work is done.
    """
    pairs: dict = {}
    host_args = _mirror(args, pairs)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for dev, host in pairs.values():
            host.copy_(dev, non_blocking=True)
        if pairs:
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()   # the host copies are complete before the CPU path reads them
    cpu_work = host_call(*host_args)
    writes = [pairs[id(t)] for t in plan.outputs if id(t) in pairs]

    def copy_back() -> None:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for dst, host in writes:
                dst.copy_(host)  # from pinned memory, synchronous with respect to the host

    return StagingWork(plan.op, cpu_work, [d for d, _ in writes], copy_back)
