"""Host staging: CUDA tensors through pinned host memory and this group's CPU algorithms.

For one c10d call on CUDA tensors: every CUDA tensor the call reads is copied to a pinned host
tensor on the caller's current stream, the host waits for those copies, the *same*
ProcessGroupPycoll method runs on the host copies (so validation, ordering, shared memory, TCP,
timeouts and error reporting are exactly the CPU path's), and when that CPU Work completes the
tensors the call writes are copied back to the device, on the caller's stream, before the
returned ``StagingWork`` reports completion.

This path needs no cupy and works wherever torch works; it is the fallback and, for
point-to-point calls, the way the ipc path sends and receives. It costs two copies over PCIe
per tensor and a host synchronisation at each end.
"""

from __future__ import annotations

import torch

from pycoll.cuda.work import StagingWork

# Which positional argument each c10d method reads (copied to the host) and writes (copied back).
READS_ARG0 = {"allreduce", "allreduce_coalesced", "reduce", "broadcast", "send"}
WRITES_NOTHING = {"send", "barrier", "monitored_barrier"}


def _mirror(x, copy: bool, pairs: list, stream):
    """``x`` with every CUDA tensor replaced by a pinned host copy (contents copied if ``copy``)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cuda":
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        if copy:
            host.copy_(x, non_blocking=True)
        pairs.append((x, host))
        return host
    if isinstance(x, (list, tuple)):
        return type(x)(_mirror(v, copy, pairs, stream) for v in x)
    return x


def run(pg, name: str, method, args: tuple, kwargs: dict, device: torch.device, stream) -> StagingWork:
    """Run the CPU ``method`` of ``pg`` on host copies of ``args``; see the module docstring."""
    reads, writes = [], []
    new_args = list(args)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for i, a in enumerate(args[:2]):
            reads_here = (i == 0 and name in READS_ARG0) or i == 1
            pairs: list = []
            new_args[i] = _mirror(a, reads_here, pairs, stream)
            if i == 0 and name not in WRITES_NOTHING:
                writes.extend(pairs)
            reads.extend(pairs)
        if reads:
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()   # the host copies are complete before the CPU path reads them
    cpu_work = method(pg, *new_args, **kwargs)

    def copy_back() -> None:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for dst, host in writes:
                dst.copy_(host)  # from pinned memory, synchronous with respect to the host

    return StagingWork(name, cpu_work, [d for d, _ in writes], copy_back)
