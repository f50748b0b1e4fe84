"""What a rank knows of its GPU and its CUDA software, for the choice of path.

``local_facts`` is what a rank publishes at a group's first CUDA call (see paths.RankFacts); it
asks torch about the GPUs, so it is only called once CUDA is in use. (The checks of a CUDA call's
arguments are the CPU path's: ``pycoll.c10d.checks``.)
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pycoll import rendezvous
from pycoll.cuda import paths


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
