"""Checks and facts for CUDA calls: one device per call, dtype and layout, flat views, GPU identity.

Everything a rank can check alone is checked here, before any communication, with the CPU
path's exception types. ``local_facts`` is what a rank publishes at a group's first CUDA call
(see paths.RankFacts); it asks torch about the GPUs, so it is only called once CUDA is in use.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pycoll import rendezvous
from pycoll.c10d.plans import check_dense
from pycoll.cuda import paths


def iter_tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from iter_tensors(a)


def common_device(args, what: str) -> torch.device:
    """The one CUDA device of every tensor in ``args``; ValueError on a mix."""
    devices = {t.device for t in iter_tensors(args)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"{what}: tensors of one call must all live on one CUDA device, got "
                         f"{sorted(map(str, devices))}")
    return next(iter(devices))


def check_cuda(t, what: str) -> torch.Tensor:
    return check_dense(t, what, "cuda")


def check_all(ts, what: str, exactly: int | None = None) -> list[torch.Tensor]:
    ts = list(ts)
    if exactly is not None and len(ts) != exactly:
        raise ValueError(f"{what}: expected {exactly} tensor(s) per call, got {len(ts)}")
    return [check_cuda(t, what) for t in ts]


def flat_out(t: torch.Tensor):
    """A flat contiguous output for ``t`` on its device, and the write-back (stream-ordered)."""
    if t.is_contiguous():
        return t.view(-1), lambda: None
    work = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    return work, lambda: t.copy_(work.view(t.shape))


def _parts(parts, ref, op: str) -> None:
    for p in parts:
        if p.dtype != ref.dtype:
            raise TypeError(f"{op}: dtype {p.dtype} does not match {ref.dtype}")
        if p.numel() != ref.numel():
            raise ValueError(f"{op}: tensor of {p.numel()} elements where {ref.numel()} were expected")


def gpu_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{getattr(props, 'pci_bus_id', 'gpu')}-{index}"


def nccl_importable() -> bool:
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - ImportError, or a cupy that cannot load libnccl
        return False
    return bool(getattr(nccl, "available", True))


def local_facts(device: torch.device, global_rank: int) -> paths.RankFacts:
    return paths.RankFacts(
        host=rendezvous.host_identity(global_rank), gpu=gpu_uuid(device.index),
        visible=tuple(gpu_uuid(i) for i in range(torch.cuda.device_count())),
        cupy=importlib.util.find_spec("cupy") is not None, nccl=nccl_importable(),
        requested=paths.requested_path(os.environ))
