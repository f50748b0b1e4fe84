"""Communication hooks: ``hook(state, bucket) -> torch.futures.Future[Tensor]`` (torch's contract).

A hook replaces a bucket's all-reduce. ``state`` is the process group (or None for the
default group); ``bucket`` is a ``ddp.buckets.GradBucket``. The future must resolve to the
*averaged* gradients, shaped like ``bucket.buffer()`` (the hook divides, not the reducer).
These hooks also work with torch's DDP, and torch's hooks work with ours.

On a pycoll group whose ranks share one host, the compression hooks keep each bucket's
compressed copy in registered memory (``pycoll.shared_scratch``), reused every step, so its
all-reduce runs in place like our DDP's own buckets (and, like them, counts once in RSS:
``unmap_peers``); torch's hooks allocate a new tensor each step, which takes the staged path.
"""

# No ``from __future__ import annotations`` here: torch's DDP checks that a hook's return
# annotation *is* ``torch.futures.Future[torch.Tensor]`` (a string would be refused).
import torch
import torch.distributed as dist

from .buckets import sharing_pycoll

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "allreduce_future"]


def allreduce_future(tensor: torch.Tensor, group) -> torch.futures.Future[torch.Tensor]:
    """Start a SUM all-reduce of ``tensor`` in place; a future that resolves to ``tensor``.

    Uses the Work's future when the backend offers one, so the reduction overlaps with
    whatever runs next. A backend whose Work has no future is waited for at once (correct,
    but without overlap for this hook).
    """
    work = dist.all_reduce(tensor, group=group, async_op=True)
    try:
        fut = work.get_future()
    except (RuntimeError, NotImplementedError, AttributeError):
        work.wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(tensor)
        return done
    # f.value() re-raises the collective's error instead of returning a stale tensor.
    return fut.then(lambda f: (f.value(), tensor)[1])


def _group(state):
    return state if state is not None else dist.group.WORLD


def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """The plain averaging all-reduce, as a hook (same result as registering no hook)."""
    group = _group(process_group)
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    return allreduce_future(buffer, group)


def _compressed(group, bucket, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buffer`` cast to ``dtype``: into registered memory that the group keeps per bucket
    on a one-host pycoll group (its all-reduce then runs in place, without staging), into
    a new tensor elsewhere."""
    pycoll = sharing_pycoll(group) if buffer.device.type == "cpu" else None
    if pycoll is None:
        return buffer.to(dtype)
    # (a bucket's buffer is flat, as the scratch is; unmap_peers: DDP's memory counts once
    # in RSS, as the buckets' does)
    return pycoll.shared_scratch(("ddp.hooks", bucket.index()), buffer.numel(), dtype, group,
                                 unmap_peers=True).copy_(buffer)


def _compress_hook(process_group, bucket, dtype: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    group = _group(process_group)
    buffer = bucket.buffer()
    # Divide after the cast, as torch's hooks do, so both compute bit-identical results.
    compressed = _compressed(group, bucket, buffer, dtype).div_(dist.get_world_size(group))

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value())
        return buffer

    return allreduce_future(compressed, group).then(decompress)


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in float16 (half the bytes), then copy back to its dtype."""
    return _compress_hook(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bfloat16 (half the bytes, float32's range)."""
    return _compress_hook(process_group, bucket, torch.bfloat16)
